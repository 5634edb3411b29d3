// flash_bwd.cu — backward pass of one BurstAttention ring step (FlashAttention-2 style).
//
// ---------------------------------------------------------------------------------------------
// Algorithm
// ---------------------------------------------------------------------------------------------
// In the backward ring each rank keeps K, V and fp32 dK, dV resident; the bundle (Q, dO, lse,
// delta) travels with an fp32 dQ accumulator. A ring step covers one or more rectangles
// (Blocks): visiting query rows [q_start, q_start + q_len) x resident key rows [k_start, k_start
// + k_len), global positions q_pos / k_pos; (i, j) is kept iff q_pos + i - lo <= k_pos + j <=
// q_pos + i + hi (causal: hi = 0; a sliding window: lo, hi = left, right; no bound: NO_BOUND).
// A step of one rectangle launches the kernels below over it; a step of several (documents,
// windows, zigzag chunks) launches their _steps twins once over the whole list. Per tile pair:
//
//     S  = Q K^T                      (scale folded into the exponent)
//     P  = exp2(S * scale * log2e - lse * log2e)        recomputed from lse, never stored
//     dV += P^T dO
//     dP = dO V^T
//     dS = P o (dP - delta),   delta = rowsum(dO o O)   (flash_bwd_delta, once per pass)
//     dK += scale * dS^T Q
//     dQ += scale * dS K
//
// Kernels
//   flash_bwd_delta<T>                         delta[b,h,s] = sum_d dO*O in fp32, one warp a row.
//   flash_bwd_dkdv<T, D, BM, BN, WARPS_D, DQ>  a CTA owns (batch, kv head, BN-key tile), keeps that
//       K/V tile in shared memory and loops over the group's query heads (GQA: query head h uses
//       kv head h / (H / Hkv)) and their BM-row Q tiles (double-buffered with cp.async). Warps
//       split the keys, 16 rows each, so S^T, dP^T live in mma accumulators with keys as rows:
//       P^T and dS^T are then already A fragments for dV += P^T dO and dK += dS^T Q (no smem
//       round trip). dK/dV of a kv head sum over its query heads inside one CTA: no atomics.
//       With DQ=true (default, "atomic" mode) dS is also written to shared memory and the CTA
//       adds its partial dQ = dS K into global dQ with fp32 atomicAdd, as FlashAttention-2 does.
//       WARPS_D > 1 splits the head dim of the dK/dV accumulators over WARPS_D warps that share
//       the same 16 keys (they recompute S^T, dP^T redundantly): the only way to hold a 256-wide
//       accumulator without spilling.
//   flash_bwd_dq<T, D, BM, BN, WARPS_D>        deterministic mode: a CTA owns (batch, head,
//       BM-row Q tile), loops over BN-key tiles (double-buffered), recomputes P and dP and adds
//       dQ += scale * dS K into its own rows of dQ. Used with flash_bwd_dkdv<..., false>. Every
//       output element is written by one thread in a fixed order, so two runs are bit-identical
//       (the atomic mode is not: the order of the fp32 atomicAdds varies).
//   flash_bwd_dkdv_steps, flash_bwd_dq_steps (same template arguments, same tiles): a ring
//       step's rectangle list in one launch (BwdStepParams.rects, .groups; host side
//       burstcu.ops.cuda.params.step_group_lists). dK/dV groups the rectangles by key range
//       (k_start, k_len), dQ by query range (q_start, q_len); within a step two ranges are equal
//       or disjoint (the host checks), so every output row still has one CTA writing it. Grid x
//       runs over the groups' tiles together; a CTA finds its group by a binary search of the
//       groups' first tiles (step_group_of, params.cuh), loads its resident tile once (K/V; for
//       dQ: Q, dO, lse, delta) and runs the group's rectangles in list order, each exactly as its
//       own launch would: accumulators from 0, its own Q (K/V) tiles, then dk[off] += scale *
//       acc_dk (dq, psum alike) at the end of the rectangle. So a step gives the bits of one
//       launch a rectangle in that order (the atomic dQ adds stay atomic). One fold function per
//       kernel serves both (LIST false / true), the one-rectangle kernels unchanged.
//
// On Hopper (the "sm_90a" table) flash_bwd_sm90.cu's flash_bwd_dkdv_sm90 (wgmma, TMA) takes the
// place of flash_bwd_dkdv for head dims 64, 128 and 256, and its list twin flash_bwd_dkdv_steps_sm90
// that of flash_bwd_dkdv_steps; the deterministic dQ kernels and the careful twins stay here.
//
// Masking: K/Q tile pairs wholly in the future are skipped (loop bounds); tiles straddling the
// diagonal or the ragged ends (q_len, k_len) get an element mask; loads past the ends are
// zero-filled by cp.async. Rows that saw no key in the forward pass have lse = -inf: we load
// lse*log2e as +inf for them (and for rows past q_len), so P = exp2(finite - inf) = 0, not NaN.
// Masked pairs are inert (kernels/README.md): P = 0 there in every variant; the CAREFUL variant,
// run instead when an operand could be non-finite, also forces dS = 0 there (dP = dO . v may be
// Inf or NaN) and forms dV += P^T dO, dK += dS^T Q, dQ += dS K with gemm_rs_masked, so that a
// zero weight never meets an Inf/NaN row of dO, Q or K on the tensor cores.
//
// ---------------------------------------------------------------------------------------------
// Tile sizes (burstcu/build/bwd_variants.py holds the table) and why
// ---------------------------------------------------------------------------------------------
// The FlashAttention paper starts from B_c = M / (4d) key rows (M = on-chip memory in elements):
// sm_80 164 KB / 2 B / (4 * 128) ~ 160 rows, sm_90 227 KB -> ~220. What binds first in backward,
// though, is registers: a warp holds dK and dV (16 x D/WARPS_D fp32 each: D/WARPS_D registers a
// thread) plus S^T and dP^T (16 x BM each: BM registers a thread); fragments and addresses add
// ~50-90 more. Keeping the accumulators <= ~160 gives BM = 64 for D <= 64, BM = 32 for D = 96,
// 128 and (WARPS_D = 2) 256; ptxas then reports 163-253 registers, no spills (the gate's table).
// BN sets how often Q/dO are re-read (once per BN keys), so it is as large as smem allows:
// sm_80 BN = 64 (4 warps; D = 128: 75 KB, two CTAs per SM), sm_90 BN = 128 (8 warps, 115 KB)
// for D <= 128; D = 256: BN = 64, 8 warps (WARPS_D = 2), 141 KB on both. The dq kernel holds
// dQ (D/WARPS_D) + S and dP (BN each): BM = 64 (4 warps), BN = 64 for D = 32, 64, 128; BN = 32
// for D = 256 and for D = 96 (ptxas spilled 20 B at BN = 64 there).
// The "sm_86" table is for GPUs with 99 KB (101376 B) opt-in smem a block (cc 8.6, 8.7, 8.9,
// 12.x: RTX 3090/4090/5090, A10, A40, L4, L40S). It keeps the sm_80 tiles where they fit and
// shrinks the three that do not (smem from bwd_variants.py, registers from the gate, NVRTC 13.0,
// same for fp16 and bf16):
//     kernel      D    sm_80 (BM, BN, WARPS_D)       sm_86 (BM, BN, WARPS_D)
//     dkdv, DQ    256  32 x 64 x 2, 140800 B        16 x 48 x 2, 87040 B, 192 thr, 240 regs
//     dkdv, !DQ   256  32 x 64 x 2, 135680 B        16 x 48 x 2, 84736 B, 192 thr, 232 regs
//     dq          128  64 x 64 x 1, 104448 B        64 x 32 x 1, 69632 B, 128 thr, 128 regs
//     dq          256  64 x 32 x 1, 135168 B        64 x 16 x 1, 101376 B, 128 thr, 229 regs
// dkdv D = 256 cannot keep BM = 32: two stages of Q and dO alone are 4 x 32 x 264 x 2 = 67584 B,
// and with K, V at BN = 32 it is 101888 B even without dS. BM = 16 halves that; BN = 48 (6
// warps) rather than 32 re-reads Q/dO once per 48 keys instead of 32 (BN must be a multiple of
// 16, not a power of two). dq keeps BM = 64 (K/V streamed once per 64 queries) and halves BN;
// at D = 256 that uses the whole 101376 B (no static smem), and WARPS_D = 2 was not taken: it
// would recompute S and dP twice (1.7x the mma work) for 8 warps instead of 4. Everything there
// runs one CTA a SM (100 KB a SM), D <= 128 dkdv included (75 KB); no GPU measured any of it.
// The table only picks tile sizes: each instantiation is compiled for the device's own arch.
// Shared-memory rows are padded by 8 elements (16 B) so the eight row addresses of an ldmatrix
// fall in different banks (rows of 128 or 256 B would otherwise all hit the same four banks).
//
// Napkin math (A100, fp16, D = 128, one head, causal 8K x 8K): 5 matmuls of 2*N^2*D flops,
// halved by the mask: 5 * 2 * 8192^2 * 128 / 2 ~ 43 GFLOP, ~0.2 ms at ~200 TFLOP/s usable.
// The deterministic mode recomputes S and dP in the dQ kernel: 7 matmuls instead of 5 (1.4x).
// Traffic: each of the 128 key tiles (BN = 64) re-reads on average half of Q and dO:
// 128 * 4096 rows * 128 * 2 B * 2 ~ 270 MB, ~0.18 ms at 1.5 TB/s -- as long as the math, so it
// must come from L2 (Q/dO of a head are 4 MB; A100 L2 is 40 MB) and BN is as large as smem and
// registers allow (sm_90: 128). Atomic dQ adds the same count of fp32 values (BM x D per tile
// pair, ~270 MB) as L2 reductions. No GPU was available while writing this: estimates only.
//
// The list kernels hold a few values more than one rectangle does (its bounds come from global
// memory, not the parameter space): at D = 128 and 256, where flash_bwd_dkdv already takes
// 243-255 registers, ptxas spilled 4-28 B until flash_bwd_dkdv_steps kept its rectangle in
// shared memory (ListCursor), read where used: now 254-255 registers, no spill (the gate).
// flash_bwd_dq_steps keeps its rectangle in registers (no spill; up to 237 registers at D = 128
// where flash_bwd_dq takes 168: one CTA a SM either way on sm_80, whose 104 KB of smem binds).
//
// Arguments: each kernel takes one struct by value (kernels/params.cuh): flash_bwd_delta a
// BwdDeltaParams, the step kernels the same BwdStepParams (burstcu/ops/cuda/params.py fills
// them; a list step one a kernel, each with its own grouping). Strides are 64-bit element counts,
// as in the forward, and every global index is formed in 64-bit arithmetic, so a tensor may hold
// more than 2^31 elements.
//
// Build: NVRTC, one name expression per variant of burstcu/build/bwd_variants.py (families
// bwd_delta, bwd_dkdv, bwd_dkdv_nodq, bwd_dq, their _list twins and the _careful twin of each
// step family); the gate
//   python -m burstcu.build check --arch sm_80,sm_86,sm_90
// compiles each with -Xptxas=-v and fails on any spill. On the CPU: burstcu.build.emulate
// (g++ + emu/cuda_emu.h), as tests/kernels/test_flash_bwd_emulated.py and
// test_flash_bwd_lists_emulated.py do.
// ---------------------------------------------------------------------------------------------

#include "common.cuh"
#include "params.cuh"

namespace bwd {

constexpr float kLog2e = 1.4426950408889634f;

/// A compile-time bool as a value: the argument that instantiates a generic lambda once per case.
template <bool V> struct Case {
    static constexpr bool value = V;
};

// ---------------------------------------------------------------------------------------------
// Fragment loads from shared memory (ldmatrix). Lane l supplies the row address for 8x8
// matrix l/8; matrix order matches the register order of the mma.m16n8k16 operand.
// ---------------------------------------------------------------------------------------------

/// A operand (16 x 16) at (row0, col0) of a row-major tile s[m][k] with row stride `ld`.
template <typename T>
__device__ __forceinline__ void ld_a(u32 a[4], const T* s, int ld, int row0, int col0) {
    const int lane = threadIdx.x & 31;
    ldmatrix_x4(a, s + (row0 + (lane & 15)) * ld + col0 + (lane >> 4) * 8);
}

/// A operand (16 x 16, m from m0, k from k0) read from transposed storage s[k][m].
template <typename T>
__device__ __forceinline__ void ld_a_t(u32 a[4], const T* s, int ld, int k0, int m0) {
    const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldmatrix_x4_trans(a, s + (k0 + r + (i >> 1) * 8) * ld + m0 + (i & 1) * 8);
}

/// B operands of two n8 tiles (n0..n0+15, k0..k0+15) from storage s[n][k]:
/// b[0..1] for n0..n0+7, b[2..3] for n0+8..n0+15.
template <typename T>
__device__ __forceinline__ void ld_b(u32 b[4], const T* s, int ld, int n0, int k0) {
    const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
    ldmatrix_x4(b, s + (n0 + r + (i >> 1) * 8) * ld + k0 + (i & 1) * 8);
}

// ---------------------------------------------------------------------------------------------
// Warp-level matmuls on mma.m16n8k16. C fragments: c[j][0..1] at (row g, col 8j+2t+{0,1}),
// c[j][2..3] at (row g+8, same cols), g = lane/4, t = lane%4.
// ---------------------------------------------------------------------------------------------

/// c (16 x NCOLS) = sA[a_row0 : +16, 0:D] . sB[0:NCOLS, 0:D]^T, both row-major with stride ld.
template <typename T, int NCOLS, int D>
__device__ __forceinline__ void gemm_nt(float c[NCOLS / 8][4], const T* sA, int a_row0,
                                        const T* sB, int ld) {
#pragma unroll
    for (int j = 0; j < NCOLS / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a[4];
        ld_a(a, sA, ld, a_row0, kk * 16);
#pragma unroll
        for (int nb = 0; nb < NCOLS / 16; ++nb) {
            u32 b[4];
            ld_b(b, sB, ld, nb * 16, kk * 16);
            mma_m16n8k16<T>(c[2 * nb], a, b, c[2 * nb]);
            mma_m16n8k16<T>(c[2 * nb + 1], a, b + 2, c[2 * nb + 1]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Global -> shared loads
// ---------------------------------------------------------------------------------------------

/// Copy ROWS x D elements (row r at g + r*row_stride) into s (row stride ld) with cp.async;
/// rows >= rows_valid are zero-filled and read nothing (their source is row 0, which is always
/// valid: callers pass rows_valid >= 1). Needs 16-byte aligned rows (the launcher checks).
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile_async(T* s, int ld, const T* g, long long row_stride,
                                                int rows_valid) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += NT) {
        const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
        const bool valid = r < rows_valid;
        cp_async_16(s + r * ld + col, g + (valid ? r : 0) * row_stride + col, valid);
    }
}

/// Per-query statistics of ROWS rows: lse2 = lse * log2e (+inf for rows past rows_valid and for
/// rows with lse = -inf, so that P = 0 there), delta (0 past rows_valid).
template <int ROWS, int NT>
__device__ __forceinline__ void load_row_stats(float* s_lse2, float* s_delta, const float* lse,
                                               const float* delta, int rows_valid) {
    for (int r = threadIdx.x; r < ROWS; r += NT) {
        const bool valid = r < rows_valid;
        const float l = valid ? lse[r] : -INFINITY;
        s_lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;
        s_delta[r] = valid ? delta[r] : 0.f;
    }
}

/// Whether a (query tile of bm rows at m0, key tile of bn keys at n0) pair needs the element
/// mask: a bound (hi: the causal diagonal or a window's right edge; lo: its left edge) cuts
/// through it, or it runs past k_len (rows past q_len are zeroed through lse2 = +inf).
__device__ __forceinline__ bool tile_needs_mask(int m0, int bm, int n0, int bn, int k_len, int q_pos,
                                                int k_pos, int hi, int lo) {
    return n0 + bn > k_len || k_pos + n0 + bn - 1 > q_pos + m0 + hi ||
           k_pos + n0 < q_pos + m0 + bm - 1 - lo;
}

/// acc (16 rows x 32 columns) += dS^T[mb*16.., :] . K[:, c0..c0+32): rows of dQ from the dS
/// tile stored [key][query] (stride lds) and the K tile (stride ld), BN keys. With TAINT, K's
/// Inf/NaN values are taken out of the product and the outputs a non-zero dS meets them at
/// become NaN (mma_pair_masked), so a zero (masked) dS adds nothing.
template <typename T, int BN, bool TAINT>
__device__ __forceinline__ void ds_k_unit(float acc[4][4], const T* sdS, int lds, const T* sK,
                                          int ld, int mb, int c0) {
    float taint[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        u32 a[4];
        ld_a_t(a, sdS, lds, kk * 16, mb * 16);
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            u32 bb[4];
            ld_b_t(bb, sK, ld, kk * 16, c0 + hf * 16);
            if constexpr (TAINT) {
                mma_pair_masked<T>(acc[2 * hf], acc[2 * hf + 1], taint[2 * hf], taint[2 * hf + 1], a, bb);
            } else {
                mma_m16n8k16<T>(acc[2 * hf], a, bb, acc[2 * hf]);
                mma_m16n8k16<T>(acc[2 * hf + 1], a, bb + 2, acc[2 * hf + 1]);
            }
        }
    }
    if constexpr (TAINT) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (taint[j][e] != 0.f) acc[j][e] = NAN;
    }
}

}  // namespace bwd

// ---------------------------------------------------------------------------------------------
// delta = rowsum(dO o O)
// ---------------------------------------------------------------------------------------------

/// out, dout: (B, S, H, D) in T sharing one set of strides, last dim contiguous; delta: (B, H, S)
/// fp32 (BwdDeltaParams, kernels/params.cuh). One warp per (b, s, h) row, 4 a block.
template <typename T>
__global__ void __launch_bounds__(128)
flash_bwd_delta(const __grid_constant__ BwdDeltaParams<T> p) {
    // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
    const T* __restrict__ out = p.out;
    const T* __restrict__ dout = p.dout;
    float* __restrict__ delta = p.delta;
    const long long sb = p.row_stride.b, ss = p.row_stride.s, sh = p.row_stride.h;
    const long long st_sb = p.delta_stride.b, st_sh = p.delta_stride.h;
    const int B = p.B, S = p.S, H = p.H, D = p.D;

    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= (long long)B * S * H) return;  // whole warps leave together
    const int h = (int)(row % H), s = (int)((row / H) % S), b = (int)(row / ((long long)H * S));
    const long long off = b * sb + s * ss + h * sh;
    float acc = 0.f;
    for (int d = lane; d < D; d += 32)  // consecutive lanes read consecutive elements
        acc += to_float<T>(out[off + d]) * to_float<T>(dout[off + d]);
    acc = warp_sum<32>(acc);
    if (lane == 0) delta[b * st_sb + h * st_sh + s] = acc;
}

// ---------------------------------------------------------------------------------------------
// The step kernels take one BwdStepParams (kernels/params.cuh; pointers at element (0,0,0,0)).
// p.nonfinite: device int, nonzero when q, dout, k, v or delta may make a masked pair non-finite
// (flash_any_nonfinite); the launcher issues <..., false> and <..., true> (CAREFUL) on one
// stream, exactly one runs. Each kernel has a twin over a ring step's rectangle list (_steps):
// both instantiate one fold (LIST false / true) that runs a block of threads' rectangles in order.
// ---------------------------------------------------------------------------------------------

namespace bwd {

/// The rectangles a block of threads runs: p.blk alone (rects null), or (LIST) rects[first ..
/// end), its group's, with `tile` its tile counted from the group's first (params.cuh).
struct LaunchRects {
    const BlockRect* rects;
    int first, end, tile;
};

template <bool LIST, typename T>
__device__ __forceinline__ LaunchRects launch_rects(const BwdStepParams<T>& p) {
    if constexpr (!LIST) {
        return {nullptr, 0, 1, (int)blockIdx.x};
    } else {
        const int* groups = p.groups;
        const int n_groups = p.n_groups;
        const int g = step_group_of(groups, n_groups, blockIdx.x);
        return {p.rects, groups[g], groups[g + 1], (int)blockIdx.x - groups[n_groups + 1 + g]};
    }
}

/// One rectangle as the dQ block of query rows [m0, m_last] sees it: the key tiles [it_begin,
/// n_it) holding a key some row sees (none: `live` false): keys k_pos + j <= q_pos + m_last + hi
/// (the last row) and k_pos + j >= q_pos + m0 - lo (the first).
struct KeyTiles {
    BlockRect r;
    int it_begin, n_it;
    bool live;
};

/// Where a list kernel stands in its group: the rectangle being run (`rect`, a QueryTiles or
/// KeyTiles) and its index r in rects[.. end). flash_bwd_dkdv_steps keeps it in shared memory,
/// written by thread 0 between two barriers and read where used: held in registers for the
/// whole tile loop (where the one-rectangle kernel reads p.blk from the parameter space, no
/// register at all) these values made ptxas spill at D = 128 and 256 (255 registers).
template <typename View>
struct ListCursor {
    View rect;
    const BlockRect* rects;
    const int2* key_rows;  // a packed list's runs of query rows a key (params.cuh), or null
    int r, end;
};

template <int BN>
__device__ __forceinline__ KeyTiles key_tiles(const BlockRect& r, int m0, int m_last) {
    KeyTiles v;
    v.r = r;
    const int n_end = max(0, min(r.k_len, r.q_pos + m_last + r.hi - r.k_pos + 1));
    const int first_key = r.q_pos + m0 - r.lo - r.k_pos;
    v.it_begin = first_key > 0 ? first_key / BN : 0;
    v.n_it = (n_end + BN - 1) / BN;
    v.live = v.it_begin < v.n_it;
    return v;
}

}  // namespace bwd

// ---------------------------------------------------------------------------------------------
// dK, dV (and with DQ, atomic dQ): a CTA owns (batch, kv head, BN-key tile)
// ---------------------------------------------------------------------------------------------

/// The body of flash_bwd_dkdv (LIST false: the rectangle p.blk) and flash_bwd_dkdv_steps (LIST
/// true: the rectangles of the block's key-range group, in order). The K/V tile is loaded once;
/// each rectangle then starts its dK/dV accumulators at 0, loops over its query heads and Q
/// tiles and adds them into global dK/dV, as a launch of its own would: the same bits (a packed
/// list, p.key_rows set: the same pairs in other tiles, equal within rounding).
template <typename T, int D, int BM, int BN, int WARPS_D, bool DQ, bool CAREFUL, bool LIST>
__device__ __forceinline__ void flash_bwd_dkdv_fold(const BwdStepParams<T>& p) {
    using namespace bwd;
    if ((*p.nonfinite != 0) != CAREFUL) return;  // the other variant of this launch pair runs
    // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
    const T* __restrict__ q = p.q;
    const T* __restrict__ dout = p.dout;
    const T* __restrict__ k = p.k;
    const T* __restrict__ v = p.v;
    const float* __restrict__ lse = p.lse;
    const float* __restrict__ delta = p.delta;
    float* __restrict__ dq = p.dq;
    float* __restrict__ dk = p.dk;
    float* __restrict__ dv = p.dv;
    const long long q_sb = p.q_stride.b, q_ss = p.q_stride.s, q_sh = p.q_stride.h;
    const long long k_sb = p.k_stride.b, k_ss = p.k_stride.s, k_sh = p.k_stride.h;
    const long long dq_sb = p.dq_stride.b, dq_ss = p.dq_stride.s, dq_sh = p.dq_stride.h;
    const long long dk_sb = p.dk_stride.b, dk_ss = p.dk_stride.s, dk_sh = p.dk_stride.h;
    const long long st_sb = p.stat_stride.b, st_sh = p.stat_stride.h;
    const int H = p.H, Hkv = p.Hkv;
    const float scale = p.scale;
    const LaunchRects mine = launch_rects<LIST>(p);
    constexpr int WN = BN / 16, NW = WN * WARPS_D, NT = NW * 32, DW = D / WARPS_D;
    constexpr int LD = D + 8, LDS = BM + 8;  // padded smem row strides (elements)
    static_assert(D % 32 == 0 && DW % 16 == 0 && BM % 16 == 0 && BN % 16 == 0, "tile shape");

    const int n0 = mine.tile * BN, hkv = blockIdx.y, b = blockIdx.z;
    const int group = H / Hkv;
    // the first rectangle with a Q tile that sees some key of this tile (none: nothing to add;
    // the test is uniform over the CTA)
    int r = mine.first;
    QueryTiles cur = query_tiles<BM, BN>(LIST ? mine.rects[r] : p.blk, n0);
    if constexpr (LIST)
        while (!cur.live && ++r < mine.end) cur = query_tiles<BM, BN>(mine.rects[r], n0);
    if (!cur.live) return;
    ListCursor<QueryTiles>* list = nullptr;  // LIST: where the group stands (ListCursor)
    if constexpr (LIST) {
        __shared__ ListCursor<QueryTiles> s_list;
        list = &s_list;
        if (threadIdx.x == 0) s_list = {cur, mine.rects, p.key_rows, r, mine.end};
        __syncthreads();
    }
    // the rectangle being run (LIST: each value read from shared memory where it is used) and
    // the group's key range
    const QueryTiles& rect = LIST ? list->rect : cur;
    const int &k_start = rect.r.k_start, &k_len = rect.r.k_len;

    BURSTCU_DYNAMIC_SMEM(T, sK);
    T* sV = sK + BN * LD;
    T* sQ = sV + BN * LD;        // [2][BM][LD]
    T* sdO = sQ + 2 * BM * LD;   // [2][BM][LD]
    T* sdS = sdO + 2 * BM * LD;  // [BN][LDS], DQ only
    float* sLse2 = reinterpret_cast<float*>(sdS + (DQ ? BN * LDS : 0));  // [2][BM]
    float* sDelta = sLse2 + 2 * BM;                                       // [2][BM]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wn = warp % WN, wd = warp / WN;
    const float scale_log2 = scale * kLog2e;

    {  // resident K, V tile: one cp.async group, shared by the group's rectangles
        const long long off = (long long)b * k_sb + (long long)(k_start + n0) * k_ss +
                              (long long)hkv * k_sh;
        load_tile_async<T, BN, D, NT>(sK, LD, k + off, k_ss, k_len - n0);
        load_tile_async<T, BN, D, NT>(sV, LD, v + off, k_ss, k_len - n0);
        cp_async_commit();
    }

    while (true) {  // one pass a live rectangle (once for flash_bwd_dkdv)
        const int &q_start = rect.r.q_start, &q_len = rect.r.q_len, &q_pos = rect.r.q_pos;
        const int &k_pos = rect.r.k_pos, &hi = rect.r.hi, &lo = rect.r.lo;
        const int &m_begin = rect.m_begin, &m_tiles = rect.m_tiles;
        const int n_it = group * m_tiles;  // a register: the loop tests it after its last barrier
        // Iteration it visits query head hkv*group + it / m_tiles, Q tile
        // m_begin + (it % m_tiles) * BM.
        auto prefetch = [&](int it, int stage) {
            const int h = hkv * group + it / m_tiles, m0 = m_begin + (it % m_tiles) * BM;
            const long long off = (long long)b * q_sb + (long long)(q_start + m0) * q_ss +
                                  (long long)h * q_sh;
            load_tile_async<T, BM, D, NT>(sQ + stage * BM * LD, LD, q + off, q_ss, q_len - m0);
            load_tile_async<T, BM, D, NT>(sdO + stage * BM * LD, LD, dout + off, q_ss, q_len - m0);
            cp_async_commit();
            const long long st = (long long)b * st_sb + (long long)h * st_sh + q_start + m0;
            load_row_stats<BM, NT>(sLse2 + stage * BM, sDelta + stage * BM, lse + st, delta + st,
                                   q_len - m0);
        };

        float acc_dk[DW / 8][4], acc_dv[DW / 8][4];
#pragma unroll
        for (int j = 0; j < DW / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_dk[j][e] = acc_dv[j][e] = 0.f;

        prefetch(0, 0);
        for (int it = 0; it < n_it; ++it) {
            const int stage = it & 1;
            if (it + 1 < n_it) {  // overlap the next tile's copy with this tile's math
                prefetch(it + 1, stage ^ 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();

            const int h = hkv * group + it / m_tiles, m0 = m_begin + (it % m_tiles) * BM;
            const T* q_s = sQ + stage * BM * LD;
            const T* do_s = sdO + stage * BM * LD;
            const float* lse2_s = sLse2 + stage * BM;
            const float* delta_s = sDelta + stage * BM;

            // P^T (16 keys x BM queries per warp) = exp2(S^T * scale*log2e - lse2[query]).
            float s[BM / 8][4];
            gemm_nt<T, BM, D>(s, sK, wn * 16, q_s, LD);
            // CAREFUL also masks the zero-filled query rows past q_len: lse2 = +inf gives them P = 0
            // only while S is finite, and a NaN key makes their S = 0 . NaN = NaN
            const bool masked = tile_needs_mask(m0, BM, n0, BN, k_len, q_pos, k_pos, hi, lo) ||
                                (CAREFUL && m0 + BM > q_len) || (LIST && list->key_rows != nullptr);
            // One copy of this loop per case (see flash_bwd_dq): tiles without masked pairs skip the test.
            auto scores_to_p = [&](auto mask) {
#pragma unroll
                for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n0 + wn * 16 + g + (e >> 1) * 8, qi = j * 8 + 2 * t + (e & 1);
                        float pv = exp2f(s[j][e] * scale_log2 - lse2_s[qi]);
                        // kept iff -lo <= offset <= hi, offset = key position - query position
                        const int offset = k_pos + key - q_pos - m0 - qi;
                        if (decltype(mask)::value && (key >= k_len || offset > hi || offset < -lo ||
                                                      (CAREFUL && m0 + qi >= q_len)))
                            pv = 0.f;
                        s[j][e] = pv;
                    }
                // a packed list (params.cuh): P = 0 too where the query row lies outside the run of
                // rows that see this thread's key, after the exponentials, reading the run (and the
                // pointer, from the cursor) where each element is tested: a run held in registers
                // through the loop took the d = 256 kernel on the sm_90 table past 255 registers
                if constexpr (LIST && decltype(mask)::value) {
                    const int2* __restrict__ key_rows = list->key_rows;
                    if (key_rows != nullptr) {
#pragma unroll
                        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int key = n0 + wn * 16 + g + (e >> 1) * 8;
                                const int qi = q_start + m0 + j * 8 + 2 * t + (e & 1);
                                const volatile int* run = reinterpret_cast<const volatile int*>(
                                    key_rows + k_start + min(key, k_len - 1));
                                if (key >= k_len || qi < run[0] || qi >= run[1]) s[j][e] = 0.f;
                            }
                    }
                }
            };
            if (masked)
                scores_to_p(Case<true>{});
            else
                scores_to_p(Case<false>{});
            if constexpr (CAREFUL)  // dV += P^T dO
                gemm_rs_masked<T, BM, DW>(acc_dv, s, do_s, LD, wd * DW, masked);
            else
                gemm_rs<T, BM, DW>(acc_dv, s, do_s, LD, wd * DW);

            // dS^T = P^T o (dP^T - delta[query]),  dP^T = V dO^T.
            float ds[BM / 8][4];
            gemm_nt<T, BM, D>(ds, sV, wn * 16, do_s, LD);
#pragma unroll
            for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {  // CAREFUL: P = 0 gives dS = 0 whatever dP is
                    const float d_s = s[j][e] * (ds[j][e] - delta_s[j * 8 + 2 * t + (e & 1)]);
                    ds[j][e] = CAREFUL && s[j][e] == 0.f ? 0.f : d_s;
                }
            if constexpr (CAREFUL)  // dK += dS^T Q (scaled at the end)
                gemm_rs_masked<T, BM, DW>(acc_dk, ds, q_s, LD, wd * DW, masked);
            else
                gemm_rs<T, BM, DW>(acc_dk, ds, q_s, LD, wd * DW);

            if constexpr (DQ) {
                if (wd == 0) {  // warps sharing keys hold the same dS: one of them stores it
#pragma unroll
                    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const int row = wn * 16 + g + hf * 8, col = j * 8 + 2 * t;
                            *reinterpret_cast<u32*>(sdS + row * LDS + col) =
                                pack2<T>(ds[j][2 * hf], ds[j][2 * hf + 1]);
                        }
                }
                __syncthreads();
                // dQ (BM x D) += scale * dS (BM x BN) . K (BN x D): units of 16 rows x 32 columns.
                constexpr int MB = BM / 16, NCH = D / 32;
                for (int u = warp; u < MB * NCH; u += NW) {
                    const int mb = u % MB, c0 = (u / MB) * 32;
                    float acc[4][4] = {};
                    // a zero dS must add nothing even against an Inf/NaN key (gemm_rs_masked's rule)
                    if (CAREFUL && masked && warp_any_nonfinite<T, BN, 32>(sK + c0, LD))
                        ds_k_unit<T, BN, true>(acc, sdS, LDS, sK, LD, mb, c0);
                    else
                        ds_k_unit<T, BN, false>(acc, sdS, LDS, sK, LD, mb, c0);
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = m0 + mb * 16 + g + (e >> 1) * 8;
                        if (row >= q_len) continue;
                        float* dst = dq + (long long)b * dq_sb + (long long)(q_start + row) * dq_ss +
                                     (long long)h * dq_sh + c0 + 2 * t + (e & 1);
#pragma unroll
                        for (int j = 0; j < 4; ++j) atomicAdd(dst + j * 8, scale * acc[j][e]);
                    }
                }
            }
            __syncthreads();  // stage `stage` (and sdS) is overwritten by the next prefetch
        }

        // This CTA is the only writer of its dK/dV rows in this launch: plain read-add-write,
        // no atomics (a rectangle at a time, as its own launch would add them).
#pragma unroll
        for (int j = 0; j < DW / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = n0 + wn * 16 + g + (e >> 1) * 8;
                if (row >= k_len) continue;
                const long long off = (long long)b * dk_sb + (long long)(k_start + row) * dk_ss +
                                      (long long)hkv * dk_sh + wd * DW + j * 8 + 2 * t + (e & 1);
                dk[off] += scale * acc_dk[j][e];
                dv[off] += acc_dv[j][e];
            }
        if constexpr (!LIST) {
            break;
        } else {  // the group's next live rectangle, once every thread is done with this one
            __syncthreads();
            if (threadIdx.x == 0) {
                int next = list->r;
                QueryTiles view;
                do {
                    ++next;
                } while (next < list->end && !(view = query_tiles<BM, BN>(list->rects[next], n0)).live);
                list->r = next;
                list->rect = view;
            }
            __syncthreads();  // (stages and sdS are free: the tile loop ended on a barrier)
            if (list->r >= list->end) break;
        }
    }
}

/// Grid (ceil(k_len / BN), Hkv, B); block (BN/16) * WARPS_D warps; dynamic smem
/// bwd_dkdv_smem_bytes (see bwd_variants.py): K, V tiles, two stages of Q, dO, lse2, delta,
/// and with DQ a BN x BM tile of dS.
template <typename T, int D, int BM, int BN, int WARPS_D, bool DQ, bool CAREFUL = false>
__global__ void __launch_bounds__((BN / 16) * WARPS_D * 32)
flash_bwd_dkdv(const __grid_constant__ BwdStepParams<T> p) {
    flash_bwd_dkdv_fold<T, D, BM, BN, WARPS_D, DQ, CAREFUL, false>(p);
}

/// A ring step's rectangles in one launch (p.rects, p.groups grouped by key range): grid (the
/// groups' key tiles together, Hkv, B); block and smem as flash_bwd_dkdv's.
template <typename T, int D, int BM, int BN, int WARPS_D, bool DQ, bool CAREFUL = false>
__global__ void __launch_bounds__((BN / 16) * WARPS_D * 32)
flash_bwd_dkdv_steps(const __grid_constant__ BwdStepParams<T> p) {
    flash_bwd_dkdv_fold<T, D, BM, BN, WARPS_D, DQ, CAREFUL, true>(p);
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: a CTA owns (batch, head, BM-row Q tile)
// ---------------------------------------------------------------------------------------------

/// The body of flash_bwd_dq (LIST false: the rectangle p.blk) and flash_bwd_dq_steps (LIST
/// true: the rectangles of the block's query-range group, in order). The Q, dO tile and the
/// rows' lse, delta are read once; each rectangle then starts its dQ accumulator (and row sums
/// of P) at 0, streams its own K/V tiles and adds them into global dQ (and psum), as a launch
/// of its own would: the same bits (a packed list, p.row_keys set: the same pairs in other
/// tiles, equal within rounding).
template <typename T, int D, int BM, int BN, int WARPS_D, bool CAREFUL, bool LIST>
__device__ __forceinline__ void flash_bwd_dq_fold(const BwdStepParams<T>& p) {
    using namespace bwd;
    if ((*p.nonfinite != 0) != CAREFUL) return;  // the other variant of this launch pair runs
    // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
    const T* __restrict__ q = p.q;
    const T* __restrict__ dout = p.dout;
    const T* __restrict__ k = p.k;
    const T* __restrict__ v = p.v;
    const float* __restrict__ lse = p.lse;
    const float* __restrict__ delta = p.delta;
    float* __restrict__ dq = p.dq;
    float* __restrict__ psum = p.psum;
    const bool with_psum = psum != nullptr;
    const long long q_sb = p.q_stride.b, q_ss = p.q_stride.s, q_sh = p.q_stride.h;
    const long long k_sb = p.k_stride.b, k_ss = p.k_stride.s, k_sh = p.k_stride.h;
    const long long dq_sb = p.dq_stride.b, dq_ss = p.dq_stride.s, dq_sh = p.dq_stride.h;
    const long long st_sb = p.stat_stride.b, st_sh = p.stat_stride.h;
    const int H = p.H, Hkv = p.Hkv;
    const float scale = p.scale;
    // a packed list (params.cuh): each query row's run of keys masks too, in every tile
    const int2* __restrict__ row_keys = LIST ? p.row_keys : nullptr;
    const LaunchRects mine = launch_rects<LIST>(p);
    constexpr int WM = BM / 16, NW = WM * WARPS_D, NT = NW * 32, DW = D / WARPS_D;
    constexpr int LD = D + 8;
    static_assert(D % 32 == 0 && DW % 16 == 0 && BM % 16 == 0 && BN % 16 == 0, "tile shape");

    const int m0 = mine.tile * BM, h = blockIdx.y, b = blockIdx.z;
    const int hkv = h / (H / Hkv);
    // the query rows: one range a group
    const BlockRect& rows = LIST ? mine.rects[mine.first] : p.blk;
    const int q_start = rows.q_start, q_len = rows.q_len;
    if (m0 >= q_len) return;
    const int m_last = min(m0 + BM, q_len) - 1;
    // the first rectangle with a key some row of the tile sees (none: nothing to add)
    int r = mine.first;
    KeyTiles cur = key_tiles<BN>(LIST ? mine.rects[r] : p.blk, m0, m_last);
    if constexpr (LIST)
        while (!cur.live && ++r < mine.end) cur = key_tiles<BN>(mine.rects[r], m0, m_last);
    if (!cur.live) return;

    BURSTCU_DYNAMIC_SMEM(T, sQ);
    T* sdO = sQ + BM * LD;
    T* sK = sdO + BM * LD;     // [2][BN][LD]
    T* sV = sK + 2 * BN * LD;  // [2][BN][LD]

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp % WM, wd = warp / WM;
    const float scale_log2 = scale * kLog2e;

    {
        const long long off = (long long)b * q_sb + (long long)(q_start + m0) * q_ss +
                              (long long)h * q_sh;
        load_tile_async<T, BM, D, NT>(sQ, LD, q + off, q_ss, q_len - m0);
        load_tile_async<T, BM, D, NT>(sdO, LD, dout + off, q_ss, q_len - m0);
        cp_async_commit();
    }

    // This thread's two query rows (g and g + 8 of the warp's 16): lse2 and delta in registers.
    float lse2[2], dlt[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int row = m0 + wm * 16 + g + hf * 8;
        const long long st = (long long)b * st_sb + (long long)h * st_sh + q_start + row;
        const float l = row < q_len ? lse[st] : -INFINITY;
        lse2[hf] = l == -INFINITY ? INFINITY : l * kLog2e;
        dlt[hf] = row < q_len ? delta[st] : 0.f;
    }

    while (true) {  // one pass a live rectangle (once for flash_bwd_dq)
        const int k_start = cur.r.k_start, k_len = cur.r.k_len, q_pos = cur.r.q_pos;
        const int k_pos = cur.r.k_pos, hi = cur.r.hi, lo = cur.r.lo;
        const int it_begin = cur.it_begin, n_it = cur.n_it;
        auto prefetch = [&](int it, int stage) {
            const int n0 = it * BN;
            const long long off = (long long)b * k_sb + (long long)(k_start + n0) * k_ss +
                                  (long long)hkv * k_sh;
            load_tile_async<T, BN, D, NT>(sK + stage * BN * LD, LD, k + off, k_ss, k_len - n0);
            load_tile_async<T, BN, D, NT>(sV + stage * BN * LD, LD, v + off, k_ss, k_len - n0);
            cp_async_commit();
        };

        float acc[DW / 8][4];
#pragma unroll
        for (int j = 0; j < DW / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        float p_sum[2] = {0.f, 0.f};  // this lane's part of its two rows' sum of P (with_psum)

        prefetch(it_begin, 0);
        for (int it = it_begin; it < n_it; ++it) {
            const int stage = (it - it_begin) & 1, n0 = it * BN;
            if (it + 1 < n_it) {
                prefetch(it + 1, stage ^ 1);
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const T* k_s = sK + stage * BN * LD;
            const T* v_s = sV + stage * BN * LD;

            float s[BN / 8][4];  // S, then P (16 queries x BN keys per warp)
            gemm_nt<T, BN, D>(s, sQ, wm * 16, k_s, LD);
            const bool masked = tile_needs_mask(m0, BM, n0, BN, k_len, q_pos, k_pos, hi, lo) ||
                                row_keys != nullptr;
            // One copy of this loop per case, so that the tiles without masked pairs (all but the
            // diagonal and the ragged ends) run without the test. As one loop testing a run-time
            // `masked`, the split was left to the compiler's heuristics, which stopped making it
            // when the arguments became a struct: about 40 more registers at D = 128 (NVRTC 13.0,
            // sm_80).
            auto scores_to_p = [&](auto mask) {
                // LIST: the keys key_first[hf] .. key_last[hf] of the rectangle this thread's row hf may
                // see: its bounds, k_len and (packed) its run of keys (a row past q_len: none)
                int key_first[2] = {0, 0}, key_last[2] = {0, 0};
                if constexpr (LIST && decltype(mask)::value) {
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int qi = m0 + wm * 16 + g + hf * 8;
                        key_first[hf] = q_pos + qi - lo - k_pos;
                        key_last[hf] = min(k_len - 1, q_pos + qi + hi - k_pos);
                        if (row_keys != nullptr) {
                            const int2 run = qi < q_len ? row_keys[q_start + qi] : make_int2(0, 0);
                            key_first[hf] = max(key_first[hf], run.x - k_start);
                            key_last[hf] = min(key_last[hf], run.y - 1 - k_start);
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int qi = m0 + wm * 16 + g + (e >> 1) * 8, key = n0 + j * 8 + 2 * t + (e & 1);
                        float pv = exp2f(s[j][e] * scale_log2 - lse2[e >> 1]);
                        if constexpr (LIST) {
                            if (decltype(mask)::value && (key < key_first[e >> 1] || key > key_last[e >> 1]))
                                pv = 0.f;
                        } else {
                            if (decltype(mask)::value && (key >= k_len || k_pos + key > q_pos + qi + hi ||
                                                          k_pos + key < q_pos + qi - lo))
                                pv = 0.f;
                        }
                        s[j][e] = pv;
                    }
            };
            if (masked)
                scores_to_p(Case<true>{});
            else
                scores_to_p(Case<false>{});
            if (with_psum) {
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) p_sum[e >> 1] += s[j][e];
            }
            float ds[BN / 8][4];  // dP = dO V^T, then dS
            gemm_nt<T, BN, D>(ds, sdO, wm * 16, v_s, LD);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {  // CAREFUL: P = 0 gives dS = 0 whatever dP is
                    const float d_s = s[j][e] * (ds[j][e] - dlt[e >> 1]);
                    ds[j][e] = CAREFUL && s[j][e] == 0.f ? 0.f : d_s;
                }
            if constexpr (CAREFUL)  // dQ += dS K (scaled at the end)
                gemm_rs_masked<T, BN, DW>(acc, ds, k_s, LD, wd * DW, masked);
            else
                gemm_rs<T, BN, DW>(acc, ds, k_s, LD, wd * DW);
            __syncthreads();
        }

#pragma unroll
        for (int j = 0; j < DW / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = m0 + wm * 16 + g + (e >> 1) * 8;
                if (row >= q_len) continue;
                const long long off = (long long)b * dq_sb + (long long)(q_start + row) * dq_ss +
                                      (long long)h * dq_sh + wd * DW + j * 8 + 2 * t + (e & 1);
                dq[off] += scale * acc[j][e];
            }
        if (with_psum) {
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float total = warp_sum<4>(p_sum[hf]);  // the 4 lanes of a row group
                const int row = m0 + wm * 16 + g + hf * 8;
                if (t == 0 && wd == 0 && row < q_len)
                    psum[(long long)b * st_sb + (long long)h * st_sh + q_start + row] += total;
            }
        }
        if constexpr (!LIST) break;
        // the group's next live rectangle (both K/V stages are free: the last iteration ended
        // on a barrier)
        do {
            ++r;
        } while (r < mine.end && !(cur = key_tiles<BN>(mine.rects[r], m0, m_last)).live);
        if (r >= mine.end) break;
    }
}

/// Grid (ceil(q_len / BM), H, B); block (BM/16) * WARPS_D warps; dynamic smem
/// bwd_dq_smem_bytes: Q, dO tiles and two stages of K, V. The same struct as flash_bwd_dkdv
/// (dk, dv unused); with p.psum non-null each row's sum of the recomputed P over this step's
/// keys is added to psum (attention_backward(check=True) checks that they add up to 1 over the
/// ring). Each dQ and psum element is read, added to and written by one thread.
template <typename T, int D, int BM, int BN, int WARPS_D, bool CAREFUL = false>
__global__ void __launch_bounds__((BM / 16) * WARPS_D * 32)
flash_bwd_dq(const __grid_constant__ BwdStepParams<T> p) {
    flash_bwd_dq_fold<T, D, BM, BN, WARPS_D, CAREFUL, false>(p);
}

/// A ring step's rectangles in one launch (p.rects, p.groups grouped by query range): grid
/// (the groups' query tiles together, H, B); block and smem as flash_bwd_dq's.
template <typename T, int D, int BM, int BN, int WARPS_D, bool CAREFUL = false>
__global__ void __launch_bounds__((BM / 16) * WARPS_D * 32)
flash_bwd_dq_steps(const __grid_constant__ BwdStepParams<T> p) {
    flash_bwd_dq_fold<T, D, BM, BN, WARPS_D, CAREFUL, true>(p);
}
