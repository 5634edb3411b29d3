/*
flash_decode.cu — decode: a few new query rows against one rank's KV cache rows ("flash
decoding": the keys are split, every split reduced on its own, the splits merged).

ALGORITHM
Shapes: q (B, T, H, D) the new tokens; k, v (B, S, Hkv, D) the cache rows this rank holds, of
which the first n_b are valid for batch row b (lengths, int32 (B,)); rows past n_b are never
read. Query head h uses kv head h / (H / Hkv), so the R = (H / Hkv) * T query rows of one kv head
(its G query heads x T tokens) share every key load.
    flash_decode_split   grid (splits, Hkv * row_groups, B), NWARPS warps a block
        split s covers keys [s * chunk, min((s + 1) * chunk, n_b)) of kv head hk;
        the block's query rows (at most ROWS of the R; row_groups = ceil(R / ROWS)) go to
        shared memory in fp32, scaled by scale * log2(e);
        warp w walks keys j = start + w, start + w + NWARPS, ... : lane l holds elements
        l, l + 32, ... (DPL = D / 32 of them, rounded up) of k_j and v_j;
            for each query row r: s = warp_sum(q_r . k_j) (every lane holds it)
                m' = max(m_r, s); l_r = l_r * exp2(m_r - m') + exp2(s - m');
                acc_r = acc_r * exp2(m_r - m') + exp2(s - m') * v_j;  m_r = m'
        the warps' states merge through shared memory into the split's (m, l, acc), written to
        the workspace: m, l (B, H, T, splits) and acc (B, H, T, splits, D), fp32, base 2.
    flash_decode_combine  grid (T * H, B), DECODE_COMBINE_THREADS threads over D
        M = max_s m_s; w_s = exp2(m_s - M); l = sum_s w_s l_s; acc = sum_s w_s acc_s
        written as the rank's partial in natural-log units: acc (B, T, H, D) (un-normalised,
        relative to m), m (B, H, T) = M * ln 2, l (B, H, T) — what burstcu.ops.decode.partial
        returns on the CPU, so the ranks' partials merge alike (burstcu.ops.decode.merge).
A row that saw no valid key keeps m = -inf, l = 0, acc = 0; exponents use 0 in place of an -inf
maximum (the finite -inf guard of flash_fwd.cu), so no NaN comes from empty splits or rows.
The kernel is memory-bound (each K/V byte is read once per row group); no tensor cores.

VARIANTS (burstcu/build/decode_variants.py)
    flash_decode_split<T, DPL, ROWS, NWARPS>   T in {__half, __nv_bfloat16, float}; DPL in
        {1, 2, 4, 8} (D <= 32 * DPL), ROWS = 16 (DPL <= 4) or 8 (DPL = 8): DPL * ROWS <= 64
        fp32 accumulators a lane
    flash_decode_combine   one kernel for every dtype (fp32 in, fp32 out)
*/
#pragma once

#include "common.cuh"

// Everything the split kernel reads; element strides (64-bit) of q (B, T, H, D) and k, v
// (B, S, Hkv, D) along their first three axes (the last is contiguous).
template <typename T>
struct DecodeSplitParams {
  const T* q;               // (B, T, H, D)
  const T* k;               // (B, S, Hkv, D)
  const T* v;               // (B, S, Hkv, D), k's strides
  const int* lengths;       // (B,): valid cache rows of each batch row
  float* ws_m;              // (B, H, T, splits) running max, base 2
  float* ws_l;              // (B, H, T, splits) running sum
  float* ws_acc;            // (B, H, T, splits, D) un-normalised output
  long long q_sb, q_st, q_sh;
  long long k_sb, k_ss, k_sh;
  int T_, H, Hkv, D;        // new tokens, query heads, kv heads, head dim
  int chunk, splits;        // keys a split, splits a row
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

namespace decode {

template <int ROWS, int NWARPS>
struct Smem {
  float q[ROWS * 256];                  // the block's query rows, scaled (D <= 256)
  float m[NWARPS][ROWS];                // each warp's state, for the merge
  float l[NWARPS][ROWS];
};

}  // namespace decode

template <typename T, int DPL, int ROWS, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
flash_decode_split(const __grid_constant__ DecodeSplitParams<T> p) {
  // fields used below, read once (see params.cuh on reading parameter structs)
  const int T_ = p.T_, H = p.H, Hkv = p.Hkv, D = p.D, chunk = p.chunk, splits = p.splits;
  const float scale_log2 = p.scale_log2;
  const int G = H / Hkv, R = G * T_;
  const int groups = (R + ROWS - 1) / ROWS;
  const int split = blockIdx.x, hk = blockIdx.y / groups, group = blockIdx.y % groups;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = group * ROWS, rows = min(ROWS, R - row0);
  const int n = p.lengths[b];
  const int start = split * chunk, stop = min(start + chunk, n);
  const long long k_ss = p.k_ss;

  __shared__ decode::Smem<ROWS, NWARPS> smem;
  // query row r of the block is (query head hk * G + g, token t) with row0 + r = g * T + t
  for (int i = threadIdx.x; i < rows * D; i += NWARPS * 32) {
    const int r = i / D, d = i % D;
    const int g = (row0 + r) / T_, t = (row0 + r) % T_;
    const T* src = p.q + b * p.q_sb + t * p.q_st + (long long)(hk * G + g) * p.q_sh;
    smem.q[r * D + d] = to_float(src[d]) * scale_log2;
  }
  __syncthreads();

  float m[ROWS], l[ROWS], acc[ROWS][DPL];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[r][e] = 0.f;
  }
  const T* kb = p.k + b * p.k_sb + (long long)hk * p.k_sh;
  const T* vb = p.v + b * p.k_sb + (long long)hk * p.k_sh;
  for (int j = start + warp; j < stop; j += NWARPS) {
    float kj[DPL], vj[DPL];
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane + 32 * e;
      kj[e] = d < D ? to_float(kb[j * k_ss + d]) : 0.f;
      vj[e] = d < D ? to_float(vb[j * k_ss + d]) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (r >= rows) break;
      float part = 0.f;
#pragma unroll
      for (int e = 0; e < DPL; ++e) {
        const int d = lane + 32 * e;
        part += d < D ? smem.q[r * D + d] * kj[e] : 0.f;
      }
      const float s = warp_sum<32>(part);
      const float m_new = fmaxf(m[r], s);
      const float base = m_new == -INFINITY ? 0.f : m_new;      // finite -inf guard
      const float keep = exp2f(m[r] - base), w = exp2f(s - base);
      l[r] = l[r] * keep + w;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[r][e] = acc[r][e] * keep + w * vj[e];
      m[r] = m_new;
    }
  }

  // merge the warps: every warp rescales to the block's max, then the sums go through smem
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      smem.m[warp][r] = m[r];
      smem.l[warp][r] = l[r];
    }
  }
  __syncthreads();
  const long long row_stride = (long long)splits;   // ws_m/ws_l: (B, H, T, splits)
  // unrolled with a uniform exit, so m[r] and acc[r][.] stay in registers (a loop indexing them
  // with a run-time r would put them in local memory)
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r >= rows) break;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) top = fmaxf(top, smem.m[w][r]);
    const float base = top == -INFINITY ? 0.f : top;
    const float mine = exp2f(m[r] - base);
    const int g = (row0 + r) / T_, t = (row0 + r) % T_, h = hk * G + g;
    const long long row = (((long long)b * H + h) * T_ + t) * row_stride + split;
    if (warp == 0 && lane == 0) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < NWARPS; ++w) sum += smem.l[w][r] * exp2f(smem.m[w][r] - base);
      p.ws_m[row] = top;
      p.ws_l[row] = sum;
    }
    // acc: the warps add their rescaled columns one after another (smem.q is free now)
    __syncthreads();
    for (int w = 0; w < NWARPS; ++w) {
      if (warp == w) {
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
          const int d = lane + 32 * e;
          if (d < D) smem.q[d] = (w == 0 ? 0.f : smem.q[d]) + acc[r][e] * mine;
        }
      }
      __syncthreads();
    }
    for (int d = threadIdx.x; d < D; d += NWARPS * 32) p.ws_acc[row * D + d] = smem.q[d];
    __syncthreads();
  }
}

#define DECODE_COMBINE_THREADS 128

__global__ void __launch_bounds__(DECODE_COMBINE_THREADS)
flash_decode_combine(const __grid_constant__ DecodeCombineParams p) {
  const int T_ = p.T_, H = p.H, D = p.D, splits = p.splits;
  const int h = blockIdx.x / T_, t = blockIdx.x % T_, b = blockIdx.y;
  const long long row = ((long long)b * H + h) * T_ + t;          // in (B, H, T)
  const float* m = p.ws_m + row * splits;
  const float* l = p.ws_l + row * splits;
  float top = -INFINITY;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, m[s]);
  const float base = top == -INFINITY ? 0.f : top;
  float* out = p.acc + (((long long)b * T_ + t) * H + h) * D;      // (B, T, H, D)
  for (int d = threadIdx.x; d < D; d += DECODE_COMBINE_THREADS) {
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) sum += exp2f(m[s] - base) * p.ws_acc[(row * splits + s) * D + d];
    out[d] = sum;
  }
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int s = 0; s < splits; ++s) total += exp2f(m[s] - base) * l[s];
    p.m[row] = top == -INFINITY ? -INFINITY : top * 0.6931471805599453f;    // ln 2
    p.l[row] = total;
  }
}
