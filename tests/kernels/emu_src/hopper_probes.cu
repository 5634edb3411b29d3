// hopper_probes.cu — small kernels exercising the emulator's sm_90 machinery (kernels/emu/emu_hopper.h)
// through kernels/hopper.cuh, for tests/kernels/test_emu_hopper.py. Ordinary CUDA apart from the
// stand-in wgmma math (emulator only) and a 2-d TMA helper that hopper.cuh does not have.
#include "hopper.cuh"

// A 2-d bulk tensor copy (hopper.cuh has only the 4-d one).
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(smem_addr(dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
#elif defined(BURSTCU_EMU)
  const int c[2] = {c0, c1};
  ::emu::tma_load(dst, map, bar, c, 2);
#endif
}

// ---- mbarrier semantics and errors. Thread 0 works, the others exit at once. maps[0]: 2-d, boxes of
// 32 f16 x 1 row (64 bytes), no swizzle; maps[1]: boxes of 64 f16 x 1 row, 128B swizzle; maps[2]:
// boxes of 256 x 256 f16 (128 KiB). The barrier is at shared offset bar_off. out: try_wait results
// (1/0) and landed halves, in order.
__global__ void probe_mbar(int mode, const TensorMap* maps, int bar_off, int* out) {
  BURSTCU_DYNAMIC_SMEM(unsigned char, smem);
  u64* bar = reinterpret_cast<u64*>(smem + bar_off);
  if (threadIdx.x != 0) return;
  int n = 0;
  auto rec = [&](bool v) { out[n++] = v ? 1 : 0; };
  auto halves = [&](int off) {
    for (int i = 0; i < 32; ++i) out[n++] = reinterpret_cast<const u16*>(smem + off)[i];
  };
  switch (mode) {
    case 0:  // phases, parity, expect_tx accounting
      mbar_init(bar, 2);
      rec(mbar_try_wait(bar, 1));  // 1: a fresh barrier is in phase 0; "the phase of parity 1" has completed
      rec(mbar_try_wait(bar, 0));  // 0
      mbar_arrive(bar);
      rec(mbar_try_wait(bar, 0));  // 0: one arrival of two
      mbar_arrive(bar);
      rec(mbar_try_wait(bar, 0));  // 1: phase 0 completed
      rec(mbar_try_wait(bar, 1));  // 0: phase 1 is current
      mbar_arrive_expect_tx(bar, 128);  // phase 1: 2 arrivals, 128 bytes
      mbar_arrive(bar);
      rec(mbar_try_wait(bar, 1));  // 0: arrivals complete, 128 bytes outstanding
      tma_load_2d(smem, &maps[0], bar, 0, 0);
      rec(mbar_try_wait(bar, 1));  // 0: the first 64 bytes land, 64 outstanding
      tma_load_2d(smem + 128, &maps[0], bar, 0, 1);
      rec(mbar_try_wait(bar, 1));  // 1: the second lands, the phase completes
      halves(0);                    // row 0
      halves(128);                  // row 1
      rec(mbar_try_wait(bar, 1));  // 1: phase 2 is current
      rec(mbar_try_wait(bar, 0));  // 0
      tma_load_2d(smem + 256, &maps[0], bar, 0, 2);  // complete_tx before the expect_tx: tx-count goes negative
      rec(mbar_try_wait(bar, 0));  // 0: the copy lands (tx -64), no arrivals yet
      mbar_arrive_expect_tx(bar, 64);
      rec(mbar_try_wait(bar, 0));  // 0: tx 0, one arrival pending
      mbar_arrive(bar);
      rec(mbar_try_wait(bar, 0));  // 1
      halves(256);
      break;
    case 1:  // use before init
      mbar_try_wait(bar, 0);
      break;
    case 2:  // an arrival beyond the count (the phase waits for bytes)
      mbar_init(bar, 1);
      mbar_arrive_expect_tx(bar, 64);
      mbar_arrive(bar);
      break;
    case 3:  // tx-count overflow
      mbar_init(bar, 1);
      mbar_arrive_expect_tx(bar, 1u << 20);
      break;
    case 4:  // init twice
      mbar_init(bar, 1);
      mbar_init(bar, 1);
      break;
    case 5:  // expect_tx smaller than the copies
      mbar_init(bar, 1);
      mbar_arrive_expect_tx(bar, 64);
      tma_load_2d(smem, &maps[0], bar, 0, 0);
      tma_load_2d(smem + 128, &maps[0], bar, 0, 1);
      mbar_wait(bar, 0);
      break;
    case 6:  // the block ends with a copy in flight
      mbar_init(bar, 1);
      mbar_arrive_expect_tx(bar, 64);
      tma_load_2d(smem, &maps[0], bar, 0, 0);
      break;
    case 7:  // two copies in flight into the same bytes
      mbar_init(bar, 1);
      mbar_init(bar + 1, 1);
      tma_load_2d(smem, &maps[0], bar, 0, 0);
      tma_load_2d(smem, &maps[0], bar + 1, 0, 1);
      break;
    case 8:  // a box over the barrier
      mbar_init(bar, 1);
      tma_load_2d(smem + bar_off, &maps[0], bar, 0, 0);
      break;
    case 9:  // an ordinary store over the barrier
      mbar_init(bar, 1);
      *bar = 0;
      mbar_arrive(bar);
      break;
    case 10: {  // a barrier in static shared memory
      __shared__ u64 static_bar;
      mbar_init(&static_bar, 1);
      break;
    }
    case 11:  // a destination that is not 128-byte aligned
      mbar_init(bar, 1);
      tma_load_2d(smem + 16, &maps[0], bar, 0, 0);
      break;
    case 12:  // a 128B-swizzled destination that is not 1024-byte aligned
      mbar_init(bar, 1);
      tma_load_2d(smem + 128, &maps[1], bar, 0, 0);
      break;
    case 13:  // parity 2
      mbar_init(bar, 1);
      mbar_try_wait(bar, 2);
      break;
    case 14:  // count 0
      mbar_init(bar, 0);
      break;
    case 15:  // nobody arrives: a deadlock, reported
      mbar_init(bar, 1);
      mbar_wait(bar, 0);
      break;
    case 16:  // tx-count underflow: 8 boxes of 128 KiB with no expect_tx
      mbar_init(bar, 1);
      for (int i = 0; i < 8; ++i) {
        tma_load_2d(smem, &maps[2], bar, 0, 0);
        rec(mbar_try_wait(bar, 0));  // the box lands: tx-count -= 131072; the arrival keeps the phase open
      }
      break;
    case 17:  // a bare try_wait loop that can never succeed: reported, not an endless loop
      mbar_init(bar, 1);
      while (!mbar_try_wait(bar, 0)) {
      }
      break;
    default: break;
  }
}

// ---- the pipeline: warpgroup 0 produces (one elected thread of warp 0 issues the copies; the rest
// exit), warpgroups 1 and 2 consume every tile and copy its landed shared bytes to out[t]. `coords`:
// (ntiles, 4) box coordinates; `stages` stages of stage_bytes (a multiple of 1024) from shared offset
// 0, then the barriers: full[stages] (count 1), empty[stages] (count 2, one elected thread of each
// consumer warpgroup). mode 0: correct. 1: the consumers read tile 0 before waiting for it.
// 2: the consumers' parity never flips (the first reuse of a stage passes early: stale data), and
// they wait properly at the end. 3: after the last tile the consumers wait for one phase too many.
// 4: the consumers arrive on empty but skip the full-barrier wait of every tile.
__global__ void probe_pipeline(int rank, const TensorMap* map, const int* coords, int ntiles, int stages,
                               int stage_bytes, int box_bytes, int mode, unsigned char* out) {
  BURSTCU_DYNAMIC_SMEM(unsigned char, smem);
  u64* full = reinterpret_cast<u64*>(smem + stages * stage_bytes);
  u64* empty = full + stages;
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 2);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (tid / 32 != 0 || !elect_one()) return;
    for (int t = 0; t < ntiles; ++t) {
      const int s = t % stages, k = t / stages;
      mbar_wait(empty + s, (k & 1) ^ 1);  // a fresh barrier passes parity 1 at once
      mbar_arrive_expect_tx(full + s, box_bytes);
      const int* c = coords + 4 * t;
      if (rank == 2)
        tma_load_2d(smem + s * stage_bytes, map, full + s, c[0], c[1]);
      else
        tma_load_4d(smem + s * stage_bytes, map, full + s, c[0], c[1], c[2], c[3]);
    }
    return;
  }
  setmaxnreg_inc<232>();
  const int cw = wg - 1, ct = tid - 128 * wg, j = tid - 128;  // consumer warpgroup, its thread, 0..255
  auto read = [&](int t, int s) {
    for (int i = 16 * j; i < box_bytes; i += 16 * 256)
      memcpy(out + size_t(t) * box_bytes + i, smem + s * stage_bytes + i, 16);
  };
  for (int t = 0; t < ntiles; ++t) {
    const int s = t % stages, k = t / stages;
    const u32 parity = mode == 2 ? 0u : u32(k & 1);
    if (mode == 1 && t == 0) {
      read(t, s);
      mbar_wait(full + s, parity);
    } else {
      if (mode != 4) mbar_wait(full + s, parity);
      read(t, s);
    }
    named_bar_sync(1 + cw, 128);  // the warpgroup has read the stage
    if (ct == 0) mbar_arrive(empty + s);
  }
  if (mode == 2) {  // once both consumers have read everything, drain: the right parity of each stage's last tile
    named_bar_sync(3, 256);
    for (int t = ntiles - stages; t < ntiles; ++t)
      if (t >= 0) mbar_wait(full + t % stages, u32((t / stages) & 1));
  }
  if (mode == 3) mbar_wait(full + 0, u32(((ntiles - 1) / stages + 1) & 1));
}

// ---- named barriers: two warpgroups take turns (ping-pong, as flash_fwd_sm90.cu does). log[0] counts,
// log[1..] records which warpgroup had the turn. mode 1: a warp arrives twice on a barrier;
// 2: lanes of a warp at different barriers; 3: a count that is not a multiple of 32; 4: warp 1 loses
// lanes 16-31 (exited) and still completes a 64-thread barrier with warp 0; 5: a deadlock.
__global__ void probe_named(int mode, int rounds, int* log) {
  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;
  if (mode == 1) {
    if (tid < 32) {
      named_bar_arrive(3, 64);
      named_bar_arrive(3, 64);
    }
    return;
  }
  if (mode == 2) {
    if (tid < 32) {
      if (lane < 16)
        named_bar_sync(3, 64);
      else
        named_bar_sync(4, 64);
    }
    return;
  }
  if (mode == 3) {
    named_bar_sync(3, 48);
    return;
  }
  if (mode == 4) {
    if (tid >= 64) return;
    if (tid >= 48) return;  // lanes 16-31 of warp 1 exit
    named_bar_sync(5, 64);
    if (tid == 0) log[0] = 1;
    return;
  }
  if (mode == 5) {  // warpgroup 1 leaves: warpgroup 0 waits for it at its turn forever (a reported deadlock)
    if (wg == 1) return;
    named_bar_sync(1, 256);
    return;
  }
  const int my_turn = 1 + wg, their_turn = 1 + (wg ^ 1);
  if (wg == 1) named_bar_arrive(their_turn, 256);  // warpgroup 0 goes first
  for (int r = 0; r < rounds; ++r) {
    named_bar_sync(my_turn, 256);
    if (tid % 128 == 0) log[1 + log[0]++] = wg;
    named_bar_arrive(their_turn, 256);
  }
  if (wg == 0) named_bar_sync(my_turn, 256);  // balance warpgroup 1's last arrival
}

// ---- elect.sync: out[t] = elect_one(). mode 1: lanes 8-31 of warp 0 exit first.
__global__ void probe_elect(int mode, int* out) {
  const int tid = threadIdx.x;
  if (mode == 1 && tid >= 8 && tid < 32) return;
  out[tid] = elect_one() ? 1 : 0;
}

// ---- red.global.add.v2.f32: thread t adds (t, -t) to the pair at out + 2 * (t % pairs) + offset,
// every thread reps times (offset 1: a misaligned address, an error).
__global__ void probe_red(float* out, int pairs, int offset, int reps) {
  const int tid = threadIdx.x;
  for (int r = 0; r < reps; ++r) red_add_v2(out + 2 * (tid % pairs) + offset, float(tid), float(-tid));
}

// ---- bulk tensor reductions: the block copies `image` (bytes) into its dynamic shared memory,
// fences and meets (__syncthreads; modes 4 and 5: named barrier 1); thread 0 adds the box at
// (c0, c1, 0, 0) of `map` from it. mode 0: one reduction, waited for (wait_group 0). 1: two, in
// two groups, waited for by wait_group.read 1, then 0. 2: thread 0 exits without waiting (an
// error). 3: thread 0 rewrites the image after the issue, before the wait (an error). 4: warp 0
// skips its fence before the named barrier (an error at the issue). 5: as 4 with every fence.
// 6: only wait_group.read 0, then exit (the adds land at the exit). 7: an empty group committed
// after the reduction's, then wait_group.read 1: the empty group is the one left pending, so the
// reduction is read (and lands at the exit). 8: an mbarrier initialised inside the source before
// the issue (an error). 9: a bulk copy of the box into the source, not waited for, then the
// reduction (an error). 10: the reduction, then a bulk copy into its source before
// wait_group.read (an error). The mbarrier of 9 and 10 sits at shared offset 3072.
__global__ void probe_reduce(const TensorMap* map, const unsigned char* image, int bytes, int c0, int c1, int mode) {
  unsigned char* smem = aligned_smem();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) smem[i] = image[i];
  if (mode != 4 || threadIdx.x >= 32) fence_proxy_async();
  if (mode >= 4)
    named_bar_sync(1, blockDim.x);
  else
    __syncthreads();
  if (threadIdx.x != 0) return;
  if (mode == 8) mbar_init(reinterpret_cast<u64*>(smem + 256), 1);
  u64* bar = reinterpret_cast<u64*>(smem + 3072);
  auto load_box = [&]() {
    mbar_init(bar, 1);
    fence_mbarrier_init();
    mbar_arrive_expect_tx(bar, bytes);
    tma_load_4d(smem, map, bar, c0, c1, 0, 0);
  };
  if (mode == 9) load_box();
  tma_reduce_add_4d(map, smem, c0, c1, 0, 0);
  bulk_commit_group();
  if (mode == 10) load_box();
  if (mode == 2) return;
  if (mode == 7) {
    bulk_commit_group();
    bulk_wait_group_read<1>();
    return;
  }
  if (mode == 1) {
    tma_reduce_add_4d(map, smem, c0, c1, 0, 0);
    bulk_commit_group();
    bulk_wait_group_read<1>();
  }
  if (mode == 3) smem[5] ^= 1;
  if (mode == 6) {
    bulk_wait_group_read<0>();
    return;
  }
  bulk_wait_group<0>();
}

// ---- setmaxnreg. mode 0: fine (warpgroup 0 dec, warpgroup 1 inc); 1: an invalid count;
// 2: warps of one warpgroup disagree; 3: warp 3 of warpgroup 0 skips it.
__global__ void probe_maxnreg(int mode, int* out) {
  const int tid = threadIdx.x, warp = tid / 32;
  if (mode == 0) {
    if (tid < 128)
      setmaxnreg_dec<40>();
    else
      setmaxnreg_inc<232>();
  } else if (mode == 1) {
    setmaxnreg_inc<20>();
  } else if (mode == 2) {
    if (warp == 1)
      setmaxnreg_inc<240>();
    else
      setmaxnreg_inc<232>();
  } else if (mode == 3) {
    if (warp != 3) setmaxnreg_dec<40>();
  }
  out[tid] = 1;
}

// ---- wgmma scheduling, with a stand-in for the math so that only the scheduling is under test:
// d[t][i] = (scale_d ? d[t][i] : 0) + (the float at shared offset desc_b.start) + (float)a_regs[t][0].
#if defined(BURSTCU_EMU)
static std::string standin_wgmma(const ::emu::WgmmaOp& op, const u32 (*a)[4], float* const* d,
                                 const unsigned char* smem, size_t smem_size) {
  const size_t off = size_t(op.desc_b & 0x3fff) << 4;
  if (off + 4 > smem_size) return "stand-in: desc_b start past shared memory";
  float b;
  memcpy(&b, smem + off, 4);
  for (int t = 0; t < 128; ++t)
    for (int i = 0; i < op.n / 2; ++i)
      d[t][i] = (op.scale_d ? d[t][i] : 0.f) + b + (op.a_in_regs ? float(a[t][0]) : 0.f);
  return "";
}
#endif

// out: (blockDim.x, 4) floats per thread: [acc[0] before the wait, acc[0] after, ...].
// modes: 0 fine (two ops, commit, accumulators read before the wait); 1 no fence; 2 accumulator written
// while in flight; 3 exit with a committed op not waited for; 4 exit with an uncommitted op;
// 5 divergent (warp 1 commits while the others fence); 6 descriptors differ between threads;
// 7 A registers changed while in flight (rs form); 8 wait<1> retires only the older group;
// 9 the real wgmma_compute on zero tiles (real = 1); 10 issue from an incomplete warpgroup;
// 11 P V after Q K^T without a second fence (flash_fwd_sm90.cu's order): fine; 12 a deadlock;
// 13 B's shared memory written while its op is in flight. 256 threads (warpgroup 1 writes B's first
// float, 3, for warpgroup 0's op): 14 with no fence before the named barrier they meet at: an error;
// 15 fenced, then the named barrier: fine; 16 fenced, then an mbarrier arrive warpgroup 0 waits on:
// fine; 17 fenced, __syncwarp, and another lane of the warp arrives on the mbarrier: fine.
__global__ void probe_wgmma(int mode, int real, float* out) {
  BURSTCU_DYNAMIC_SMEM(unsigned char, smem);  // 8 KiB
#if defined(BURSTCU_EMU)
  ::emu::set_wgmma_compute_hook(real ? nullptr : &standin_wgmma);
#endif
  const int tid = threadIdx.x;
  float* o = out + 4 * tid;
  float acc[32];
  for (int i = 0; i < 32; ++i) acc[i] = 100.f;
  u32 a[4] = {3, 0, 0, 0};
  float* fb = reinterpret_cast<float*>(smem + 4096);
  if (tid == 0) {
    *fb = 1.f;
    fence_proxy_async();  // a generic-proxy write, read next by the tensor cores (async proxy)
  }
  u64* handoff = reinterpret_cast<u64*>(smem + 7168);
  if (tid == 0) mbar_init(handoff, 1);
  __syncthreads();
  if (mode >= 14 && mode <= 17 && tid >= 128) {
    if (tid == 130) {
      *fb = 3.f;
      if (mode != 14) fence_proxy_async();
      if (mode == 16) mbar_arrive(handoff);
    }
    if (mode == 17) {
      __syncwarp();
      if (tid == 128) mbar_arrive(handoff);
    }
    if (mode == 14 || mode == 15) named_bar_sync(1, 256);
    return;
  }
  if (mode == 14 || mode == 15) named_bar_sync(1, 256);
  if (mode == 16 || mode == 17) mbar_wait(handoff, 0);
  const u64 da = wgmma_desc(smem, SWIZZLE_NONE, 128, 256);
  const u64 db = wgmma_desc(smem + 4096, SWIZZLE_NONE, 128, 256);
  switch (mode) {
    case 0:
    case 14:
    case 15:
    case 16:
    case 17:
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, false);
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, true);
      wgmma_commit();
      o[0] = acc[0];  // still 100: the ops have not executed
      wgmma_wait<0>();
      o[1] = acc[0];  // 2
      break;
    case 13:  // an operand in shared memory written while its op is in flight
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, false);
      wgmma_commit();
      if (tid == 5) *fb = 5.f;
      wgmma_wait<0>();
      break;
    case 1:
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, false);
      break;
    case 2:
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, true);
      wgmma_commit();
      if (tid == 77) acc[3] = 7.f;
      wgmma_wait<0>();
      break;
    case 3:
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, true);
      wgmma_commit();
      break;
    case 4:
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, true);
      break;
    case 5:
      if (tid / 32 == 1)
        wgmma_commit();
      else
        wgmma_fence();
      break;
    case 6: {
      wgmma_fence();
      const u64 mine = wgmma_desc(smem + 4096 + (tid == 100 ? 16 : 0), SWIZZLE_NONE, 128, 256);
      wgmma_ss<__half, 64, 0, 0>(acc, da, mine, true);
      wgmma_commit();
      wgmma_wait<0>();
      break;
    }
    case 7:
      wgmma_fence();
      wgmma_rs<__half, 64, 0>(acc, a, db, false);
      wgmma_commit();
      if (tid == 3) a[0] = 4;
      wgmma_wait<0>();
      break;
    case 8: {
      float acc2[32];
      for (int i = 0; i < 32; ++i) acc2[i] = 50.f;
      wgmma_fence();
      wgmma_rs<__half, 64, 0>(acc, a, db, false);  // group 1: 1 + 3
      wgmma_commit();
      wgmma_ss<__half, 64, 0, 0>(acc2, da, db, true);  // group 2: 50 + 1
      wgmma_commit();
      wgmma_wait<1>();
      o[0] = acc[0];   // 4
      o[1] = acc2[0];  // 50: still in flight
      wgmma_wait<0>();
      o[2] = acc2[0];  // 51
      break;
    }
    case 9: {
      for (int i = tid; i < 1024; i += blockDim.x) reinterpret_cast<float*>(smem)[i] = 0.f;
      fence_proxy_async();
      __syncthreads();
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, wgmma_desc(smem, SWIZZLE_NONE, 128, 256), false);
      wgmma_commit();
      wgmma_wait<0>();
      o[0] = acc[0];
      o[1] = acc[31];
      break;
    }
    case 10:
      wgmma_fence();
      break;
    case 12:  // warp 3 waits at __syncthreads while warps 0-2 wait at the fence: a deadlock, reported
      if (tid / 32 == 3)
        __syncthreads();
      else
        wgmma_fence();
      break;
    case 11: {
      float acc2[32];
      for (int i = 0; i < 32; ++i) acc2[i] = 50.f;
      wgmma_fence();
      wgmma_ss<__half, 64, 0, 0>(acc, da, db, false);  // "Q K^T"
      wgmma_commit();
      wgmma_rs<__half, 64, 0>(acc2, a, db, true);  // "P V"
      wgmma_commit();
      wgmma_wait<1>();
      o[0] = acc[0];  // 1
      wgmma_wait<0>();
      o[1] = acc2[0];  // 54
      break;
    }
    default: break;
  }
}
