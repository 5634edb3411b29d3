// emu_collectives.h — what each warp collective computes once all its lanes have met
// (the rendezvous itself is emu::collective in emu_runtime.h).
//
// Lane numbering: lane = linear thread index % 32, linear = x + y*bx + z*bx*by, as on the GPU.
// Shuffle source lanes follow the PTX shfl.sync rules (a source outside the lane's width-segment
// returns the lane's own value); a source lane outside the mask is an error (undefined on the GPU).
// ldmatrix and mma follow the PTX ISA fragment tables, with groupID = lane >> 2 and
// threadID_in_group = lane % 4:
//   ldmatrix m8n8 .b16: lane 8i+j gives the address of row j of matrix i; register i of lane l holds
//     row l/4, columns 2(l%4), 2(l%4)+1 of matrix i (low half first); .trans: column l/4, rows
//     2(l%4), 2(l%4)+1. Row addresses must be 16-byte aligned.
//   mma m16n8k16 (f16/bf16 in, f32 accumulate): A element a_i (i = 0..7, two per register) is at
//     row groupID (+8 for i in {2,3,6,7}), col threadID_in_group*2 + (i&1) (+8 for i >= 4);
//     B element b_i (i = 0..3) at row threadID_in_group*2 + (i&1) (+8 for i >= 2), col groupID;
//     C/D element c_i (i = 0..3) at row groupID (+8 for i >= 2), col threadID_in_group*2 + (i&1).
//   The products of two f16 or two bf16 values are exact in fp32; the emulator adds the 16 products
//   in k order in fp32 and then adds C. The tensor core's internal summation order and rounding are
//   not documented, so results can differ from the hardware in the last bits of the fp32 sum.
#pragma once

#include "emu_runtime.h"

#pragma GCC visibility push(hidden)

namespace emu {

// ---------------------------------------------------------------------------------------------
// 16-bit float formats (bit patterns). fp16 goes through _Float16 (IEEE, round to nearest even);
// g++ 12 has no bf16 arithmetic, so bf16 rounds by hand.

inline float f32_from_bits(u32 b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}
inline u32 bits_from_f32(float f) {
  u32 b;
  memcpy(&b, &f, 4);
  return b;
}
// Widening is exact; done with bit operations because g++ calls a libgcc routine for _Float16 -> float,
// which made the mma gather (384 conversions) the emulator's hottest spot.
inline float f16_to_f32(unsigned short h) {
  const u32 sign = u32(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
  const float sub = float(mant) * 5.9604644775390625e-08f;  // subnormal: mant * 2^-24, exact
  return f32_from_bits(sign | bits_from_f32(sub));
}
inline unsigned short f32_to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  unsigned short b;
  memcpy(&b, &h, 2);
  return b;
}
inline float bf16_to_f32(unsigned short b) { return f32_from_bits(u32(b) << 16); }
inline unsigned short f32_to_bf16(float f) {
  u32 u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN -> canonical NaN, as CUDA's conversion does
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest, ties to even
  return static_cast<unsigned short>(u >> 16);
}

// ---------------------------------------------------------------------------------------------

inline int shfl_source(int kind, int lane, long arg, int width) {
  const int seg = lane & ~(width - 1);
  switch (kind) {
    case K_SHFL_IDX: return seg | int(arg & (width - 1));
    case K_SHFL_UP: return (lane - seg) < arg ? lane : lane - int(arg);
    case K_SHFL_DOWN: return (lane - seg) + arg >= width ? lane : lane + int(arg);
    default: {  // xor: a source beyond the lane's own segment gives the lane's own value
      const long src = lane ^ arg;
      return (src > (seg | (width - 1)) || src < 0) ? lane : int(src);
    }
  }
}

inline void compute_shuffle(int warp, const Group& w) {
  for (int l = 0; l < 32; ++l) {
    if (!(w.mask >> l & 1u)) continue;
    Thread* t = lane_thread(warp, l);
    const int width = t->width;
    BURSTCU_EMU_CHECK(width >= 1 && width <= 32 && (width & (width - 1)) == 0,
                      "%s: %s width %d is not a power of two <= 32", where(t).c_str(), kind_name(w.kind), width);
    const int src = shfl_source(w.kind, l, t->arg, width);
    BURSTCU_EMU_CHECK(w.mask >> src & 1u, "%s: %s reads lane %d, which is not in the mask 0x%08x (undefined on the GPU)",
                      where(t).c_str(), kind_name(w.kind), src, w.mask);
    t->outv = lane_thread(warp, src)->val;
  }
}

inline void compute_vote(int warp, const Group& w) {
  u32 ballot = 0;
  for (int l = 0; l < 32; ++l)
    if ((w.mask >> l & 1u) && lane_thread(warp, l)->val) ballot |= 1u << l;
  u64 result = ballot;
  if (w.kind == K_ANY) result = ballot != 0;
  if (w.kind == K_ALL) result = ballot == w.mask;
  for (int l = 0; l < 32; ++l)
    if (w.mask >> l & 1u) lane_thread(warp, l)->outv = result;
}

inline unsigned short load_b16(const void* row, int col) {
  unsigned short v;
  memcpy(&v, static_cast<const unsigned char*>(row) + 2 * col, 2);
  return v;
}

inline void compute_ldmatrix(int warp, int kind) {
  const int v = kind - K_LDMATRIX, num = 1 << (v >> 1);
  const bool trans = v & 1;
  for (int a = 0; a < 8 * num; ++a) {  // the lanes whose addresses are used
    Thread* t = lane_thread(warp, a);
    BURSTCU_EMU_CHECK((reinterpret_cast<uintptr_t>(t->ptr) & 15) == 0, "%s: %s row address %p is not 16-byte aligned",
                      where(t).c_str(), kind_name(kind), t->ptr);
  }
  for (int l = 0; l < 32; ++l) {
    Thread* t = lane_thread(warp, l);
    const int g = l >> 2, q = l & 3;
    for (int i = 0; i < num; ++i) {
      u32 lo, hi;
      if (!trans) {
        const void* row = lane_thread(warp, 8 * i + g)->ptr;
        lo = load_b16(row, 2 * q);
        hi = load_b16(row, 2 * q + 1);
      } else {
        lo = load_b16(lane_thread(warp, 8 * i + 2 * q)->ptr, g);
        hi = load_b16(lane_thread(warp, 8 * i + 2 * q + 1)->ptr, g);
      }
      t->out[i] = lo | (hi << 16);
    }
  }
}

inline void compute_mma(int warp, Elem e) {
  float A[16][16], B[16][8], C[16][8];
  auto cvt = [e](u32 bits) { return e == Elem::f16 ? f16_to_f32(bits & 0xffff) : bf16_to_f32(bits & 0xffff); };
  for (int l = 0; l < 32; ++l) {  // gather: in[0..3] = a, in[4..5] = b, in[6..9] = c (fp32 bits)
    const Thread* t = lane_thread(warp, l);
    const int g = l >> 2, q = l & 3;
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * r + h;  // element a_i
        A[g + ((i & 2) ? 8 : 0)][2 * q + (i & 1) + (i >= 4 ? 8 : 0)] = cvt(t->in[r] >> (16 * h));
      }
    for (int r = 0; r < 2; ++r)
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * r + h;  // element b_i
        B[2 * q + (i & 1) + (i >= 2 ? 8 : 0)][g] = cvt(t->in[4 + r] >> (16 * h));
      }
    for (int i = 0; i < 4; ++i) C[g + (i >= 2 ? 8 : 0)][2 * q + (i & 1)] = f32_from_bits(t->in[6 + i]);
  }
  // S = A*B with each sum taken in k order; the loop runs over columns innermost so the 8
  // independent sums of a row vectorise (same order of additions as a plain dot product).
  float S[16][8] = {};
  for (int row = 0; row < 16; ++row)
    for (int k = 0; k < 16; ++k)
      for (int col = 0; col < 8; ++col) S[row][col] += A[row][k] * B[k][col];
  for (int l = 0; l < 32; ++l) {  // scatter D = S + C with C's layout
    Thread* t = lane_thread(warp, l);
    const int g = l >> 2, q = l & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * q + (i & 1);
      t->out[i] = bits_from_f32(S[row][col] + C[row][col]);
    }
  }
}

inline void compute_collective(int warp, const Group& w) {
  switch (w.kind) {
    case K_SYNCWARP: return;
    case K_SHFL_IDX: case K_SHFL_UP: case K_SHFL_DOWN: case K_SHFL_XOR: return compute_shuffle(warp, w);
    case K_BALLOT: case K_ANY: case K_ALL: return compute_vote(warp, w);
    case K_MMA_F16: return compute_mma(warp, Elem::f16);
    case K_MMA_BF16: return compute_mma(warp, Elem::bf16);
    case K_ELECT: case K_NAMED_BAR: case K_SETMAXNREG: return g_hopper.collective(warp, w);  // emu_hopper.h
    default: return compute_ldmatrix(warp, w.kind);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points used by common.cuh and cuda_emu.h

inline u64 shuffle(int kind, u32 mask, u64 val, long arg, int width) {
  Thread* self = g_cur;
  self->val = val;
  self->arg = arg;
  self->width = width;
  collective(kind, mask);
  return self->outv;
}

inline u64 vote(int kind, u32 mask, bool pred) {
  g_cur->val = pred;
  collective(kind, mask);
  return g_cur->outv;
}

inline void ldmatrix(u32* r, const void* row, int num, bool trans) {
  Thread* self = g_cur;
  self->ptr = row;
  collective(ldmatrix_kind(num, trans), 0xffffffffu);
  for (int i = 0; i < num; ++i) r[i] = self->out[i];
}

inline void mma_m16n8k16(float d[4], const u32 a[4], const u32 b[2], const float c[4], Elem e) {
  Thread* self = g_cur;
  for (int i = 0; i < 4; ++i) self->in[i] = a[i];
  for (int i = 0; i < 2; ++i) self->in[4 + i] = b[i];
  for (int i = 0; i < 4; ++i) self->in[6 + i] = bits_from_f32(c[i]);
  collective(e == Elem::f16 ? K_MMA_F16 : K_MMA_BF16, 0xffffffffu);
  for (int i = 0; i < 4; ++i) d[i] = f32_from_bits(self->out[i]);
}

}  // namespace emu

#pragma GCC visibility pop
