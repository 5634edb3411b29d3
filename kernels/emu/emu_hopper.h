// emu_hopper.h — the sm_90 asynchronous machinery of the emulator: shared-window offsets,
// mbarriers, bulk tensor copies (TMA) and bulk tensor reductions with their bulk async-groups,
// named barriers, elect.sync, setmaxnreg, vector reductions to global memory
// (red.global.add.v2.f32), and the warpgroup side of wgmma (fence / issue / commit / wait). kernels/hopper.cuh calls these; what one wgmma
// computes is emu_wgmma.h's wgmma_compute. Sources: the PTX ISA (mbarrier, cp.async.bulk.tensor,
// "Tensors" and "Swizzling Modes", bar.sync / bar.arrive, elect.sync, setmaxnreg, the wgmma
// fence / commit_group / wait_group) and the CUDA driver API (cuTensorMapEncodeTiled).
//
// Shared memory: every sm_90 object (mbarrier, TMA destination, wgmma tile) must live in the
// block's DYNAMIC shared memory: smem_offset(p) (hopper.cuh's smem_addr) is p's byte offset from its
// start, which is 1024-byte aligned (emu_launch.h), so offset bits are the address bits that the
// hardware's swizzle patterns use. A pointer into static __shared__ memory is an error.
//
// ---- mbarriers --------------------------------------------------------------------------------
// State lives in a side table keyed by the barrier's shared offset (reset for every block): the
// expected count, pending arrivals, tx-count and the number of completed phases. The 8 bytes of
// the object hold a checksum of that state, rewritten by every mbarrier operation and compared by
// the next one, so an ordinary store (or a TMA box) over an initialised barrier is reported
// (PTX ISA: a non-mbarrier operation on an initialised mbarrier object is undefined).
//   init(count)        count in [1, 2^20 - 1]; phase 0, pending = count, tx = 0. A second init of the
//                      same barrier in a block is an error (the ISA requires mbarrier.inval first,
//                      which hopper.cuh does not have), and so is an init while a copy is in flight.
//   arrive(tx)         tx-count += tx (expect-tx; tx = 0: plain arrive), then pending -= 1. An
//                      arrival while pending is already 0 (the phase has all its arrivals and waits
//                      for bytes) is an error; tx-count must stay in [-(2^20 - 1), 2^20 - 1].
//   complete_tx(b)     (a landing copy) tx-count -= b.
//   phase completion   pending == 0 and tx-count == 0: the phase count goes up by one and pending
//                      = count. A phase that completes while a copy that signals this barrier is
//                      still in flight is an error: the phase's expect_tx bytes were fewer than its
//                      copies' (on the GPU the late bytes would complete_tx the NEXT phase).
//   try_wait(parity)   true iff the phase of that parity has completed, i.e. the current phase's
//                      parity != parity (a fresh barrier is in phase 0: parity 1 passes at once).
//                      When not yet true, the pending copies that signal this barrier land, and the
//                      test is repeated. When still false, the thread yields (below), as the ISA's
//                      "potentially blocking" try_wait may suspend the thread.
//   wait(parity)       try_wait until true.
//
// ---- when a bulk tensor copy lands ---------------------------------------------------------------
// tma_load checks the copy and records it (with a copy of the tensor map); the global source is
// read and the shared destination written only when the copy LANDS, then complete_tx(box bytes)
// runs on its barrier. A copy lands:
//   (a) when a thread try_waits / waits on its barrier and the awaited phase is not complete yet
//       (a wait that passes at once, e.g. with a wrong parity, lands nothing);
//   (b) when every live thread is blocked or spinning and nothing changed since each spinner last
//       looked: the oldest pending copy (a random one when randomising) lands, then all look again;
//   (c) when randomising (EMU_RANDOMIZE), at each scheduling point (every fiber switch) with
//       probability 1/4, a randomly chosen pending copy. Randomising, an arriving thread also
//       yields half the time (after its arrival), so that what the arrival releases may run first.
// So a consumer that reads a stage without waiting on its full barrier reads the 0xFF poison (NaN)
// or the previous tile, and a wrong parity either passes early (stale data) or deadlocks. Two copies
// in flight into overlapping bytes, a copy over an initialised mbarrier, and a block that ends with
// copies in flight are errors.
//
// ---- spinning and deadlock -----------------------------------------------------------------------
// A failed try_wait puts the thread at the back of the run queue (state S_SPIN) and runs the next
// thread. A counter `epoch` goes up with every mbarrier / copy state change; each spinner records the
// epoch at which it last failed. If, at a failed try, every other queued thread is a spinner whose
// last failure was at the current epoch (so nothing can change: threads not queued are blocked at
// __syncthreads, a warp collective, a named barrier or a wgmma rendezvous), the emulator lands a
// copy (rule b); with none left it is a deadlock, reported like describe_deadlock (emu_launch.h)
// with each spinning thread's barrier (shared offset), awaited parity, the barrier's phase, pending
// arrivals and tx-count. mbar_wait reports at once; a bare mbar_try_wait returns false the first
// time (its caller may do something else) and reports if the same thread finds the same stuck
// state again. So a wait never hangs and never busy-loops; the watchdog remains the last resort.
//
// ---- named barriers (bar.sync / bar.arrive id, n) --------------------------------------------------
// Ids 0..15, n a positive multiple of 32 (the ISA's thread count). bar is .aligned: first the live
// lanes of the warp meet (a warp collective, K_NAMED_BAR; lanes at different barriers are an error),
// then the WARP arrives, counting 32 threads, as the ISA counts ("marks the warp's arrival"); lanes
// that have exited are not waited for and are not an error. When n threads have arrived the barrier
// completes and its bar.sync waiters go on; bar.arrive does not wait. A warp arriving twice before
// the barrier completes (the ISA's "bar.arrive followed by any other bar.* on the same barrier
// before its reset") is an error, as are different n in one phase. Barrier 0 here is independent of
// __syncthreads (which keeps its own, stricter, emulation); using both at once is an error.
//
// ---- elect.sync, setmaxnreg, fence.proxy.async -----------------------------------------------------
// elect_one: a collective of the full warp (all 32 lanes must exist and not have exited); true in
// the lowest lane. setmaxnreg(n): no effect; n in [24, 256] and a multiple of 8; a collective of the
// live lanes of the warp (.sync); all four warps of the warpgroup must execute the same sequence of
// setmaxnreg values (.aligned) — checked as each warp executes it and at the end of the block, not
// by a warpgroup rendezvous (the ISA's .sync waits only for the warp). fence_proxy_async: nothing
// to order: the emulator has one memory, so generic-proxy writes are always visible to the "async
// proxy" (TMA and wgmma read shared memory when they execute); it is recorded for two checks, each
// a proxy for the ISA's rule, not the rule. The bulk reductions' (below) sees that every thread
// arriving at the named barrier before the issue fenced since its barrier before (stricter than
// the ISA, which asks it of the writers only), not that a fence followed the thread's writes, nor
// fences before a __syncthreads or the issuer's own writes after the barrier. wgmma's compares each
// shared operand element with the async proxy's view of shared memory, refreshed at a
// synchronisation a thread that fenced takes part in (at fence_proxy_async below): it catches a
// round of stores with no fence at all before the wgmma, not a fence placed before the stores
// nor one thread's fence standing in for another's.
//
// ---- wgmma (the warpgroup side) ------------------------------------------------------------------
// wgmma_fence / wgmma_issue (mma_async) / wgmma_commit / wgmma_wait(N) are rendezvous of the 128
// threads of a warpgroup (4 consecutive warps from a warp index divisible by 4): all must arrive at
// the same kind of instruction (a different one, a missing thread, or a thread that exits while the
// others wait is an error or a reported deadlock). Execution is deferred:
//   issue   records the op: each thread's accumulator pointer, a copy of its A registers (rs form)
//           and the pointer they were read from, the descriptors and flags (identical in all 128
//           threads, else an error). The accumulators of the first pending op on each accumulator
//           pointer are snapshotted (and again after each op that executes, for the next op on it).
//   commit  closes the uncommitted ops into a wgmma-group (possibly empty).
//   wait(N) executes, in issue order, every op of every group but the newest N: wgmma_compute reads
//           shared memory NOW and writes the accumulators through the saved pointers.
// Checks: an op issued with no wgmma_fence since the warpgroup's last wait_group (or the start) is an
// error — the ISA needs the fence before the first mma_async and between register accesses and an
// mma_async using those registers; requiring it after every wait is a little stricter (an mma
// issued after a commit with no wait in between, like flash_fwd_sm90.cu's P V after Q K^T, is
// covered by the fence before the Q K^T, as the ISA says). Accumulators that changed between issue
// and execution, A registers that changed (keep the A fragment array alive and unmodified until the
// wait: the emulator reads it back to check), and a thread that exits with ops not retired by a wait
// (committed or not) are errors. So is shared memory an op reads (its A or B operand) that changed
// between the issue and the execution: a copy landed there, or a thread wrote it, while the op was
// in flight (the op's elements are recorded at the issue). A thread reading its accumulators before
// the wait sees the old values, as the ISA allows.
//
// Randomised order (EMU_RANDOMIZE) also shuffles the threads released by named barriers and wgmma
// rendezvous, and lands copies early (rule c). Everything here runs inside fibers except
// hopper_block_begin / hopper_block_end / hopper_describe, which the scheduler also calls.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "emu_collectives.h"
#include "emu_wgmma.h"

#pragma GCC visibility push(hidden)

namespace emu {

// ---------------------------------------------------------------------------------------------
// The tensor map: the emulator's host mirror of a CUtensorMap, 128 bytes, built on the host by
// burstcu/ops/cuda/tensor_map.py (field for field; offsets in bytes, little-endian):
//   u64 magic        0    0x3150414d54554342 ("BCUTMAP1" little-endian)
//   u64 base         8    global address of element (0, ..., 0); 16-byte aligned
//   u64 dims[5]      16   elements along dim i (dim 0 innermost), 1 .. 2^32; unused dims 1
//   u64 strides[5]   56   bytes between consecutive indices of dim i; strides[0] = elem_bytes; the
//                         others multiples of 16 below 2^40; unused dims ignored
//   u32 box[5]       96   box size along dim i, in elements, 1 .. 256; unused dims 1;
//                         box[0] * elem_bytes a multiple of 16 (and <= the swizzle span; a
//                         narrower row still takes a whole span in shared memory: `row_pitch`)
//   u32 rank         116  1..5
//   u32 elem_bytes   120  2 for f16 / bf16 (1, 2, 4, 8 accepted)
//   u32 swizzle      124  the DRIVER's CUtensorMapSwizzle values: 0 none, 1 32B, 2 64B, 3 128B
//                         (not the wgmma descriptor's codes: 1 is 128B there)
// Out-of-bound elements read as zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), element strides are 1,
// no interleave. The map itself must be 64-byte aligned (hopper.cuh's TensorMap is).
struct EmuTensorMap {
  u64 magic;
  u64 base;
  u64 dims[5];
  u64 strides[5];
  u32 box[5];
  u32 rank;
  u32 elem_bytes;
  u32 swizzle;
};
static_assert(sizeof(EmuTensorMap) == 128, "EmuTensorMap is 128 bytes");
static_assert(offsetof(EmuTensorMap, base) == 8 && offsetof(EmuTensorMap, dims) == 16 &&
                  offsetof(EmuTensorMap, strides) == 56 && offsetof(EmuTensorMap, box) == 96 &&
                  offsetof(EmuTensorMap, rank) == 116 && offsetof(EmuTensorMap, elem_bytes) == 120 &&
                  offsetof(EmuTensorMap, swizzle) == 124,
              "EmuTensorMap layout (burstcu/ops/cuda/tensor_map.py packs the same offsets)");
constexpr u64 kTensorMapMagic = 0x3150414d54554342ull;

// The swizzle span in bytes (0: none) of a driver CUtensorMapSwizzle value 0..3.
inline u32 swizzle_span(u32 code) { return code == 0 ? 0u : 16u << code; }

// The hardware's swizzle of a shared address (PTX ISA "Swizzling Modes"): the 16-byte chunk index,
// address bits 4.., XOR the 128-byte line index within the pattern, address bits 7..
// (1, 2 or 3 bits for the 32, 64 and 128-byte modes, repeating every 256, 512 and 1024 bytes).
inline u64 swizzle_address(u64 addr, u32 span) {
  if (span == 0) return addr;
  const u64 mask = u64(span / 16 - 1);
  return addr ^ (((addr >> 7) & mask) << 4);
}

// ---------------------------------------------------------------------------------------------
// State (one block at a time; reset by hopper_block_begin)

constexpr long long kTxMax = (1ll << 20) - 1;  // PTX ISA: tx-count in [-(2^20-1), 2^20-1]
constexpr u32 kCountMax = (1u << 20) - 1;      // expected arrival count in [1, 2^20-1]

struct MBar {
  u32 count = 0, pending = 0;
  long long tx = 0;
  u64 phase = 0;  // completed phases; the current phase's parity is phase & 1
};

struct PendingCopy {
  u64 seq = 0;
  u32 dst = 0, bar = 0, bytes = 0, extent = 0;  // extent: bytes the swizzled box may touch from dst
  int issuer = 0;                               // linear thread index
  int coords[5] = {0, 0, 0, 0, 0};
  EmuTensorMap map;
};

struct PendingReduce {  // a bulk tensor reduction (tma_reduce_add) not yet waited for
  u32 src = 0, extent = 0;  // shared offset and the bytes the swizzled box may span from it
  long group = -1;          // its bulk async-group (-1: not committed yet)
  int coords[5] = {0, 0, 0, 0, 0};
  EmuTensorMap map;
  std::vector<unsigned char> source;  // the shared bytes at issue: they must not change before the wait
  bool read = false;                  // a wait_group.read has passed it: source read, global not yet written
};

struct NamedBar {
  int expected = 0, arrived = 0;  // threads (32 per warp)
  int unfenced = 0;  // this phase's arrivals without fence_proxy_async since their barrier before
  bool fence_unseen = false;  // an arrival of this phase fenced since the async view's last refresh
  std::unordered_map<u64, int> unfenced_at;  // the same of every completed phase (by gen)
  u32 warps = 0;                  // warps that arrived in this phase
  u64 gen = 0;
  std::vector<Thread*> waiters;   // threads in bar.sync
};

enum WgKind : int { WG_NONE = 0, WG_FENCE, WG_MMA, WG_COMMIT, WG_WAIT };
inline const char* wg_kind_name(int k) {
  static const char* names[] = {"none", "wgmma_fence", "wgmma_ss/wgmma_rs (wgmma.mma_async)", "wgmma_commit",
                                "wgmma_wait"};
  return names[k];
}

struct WgOp {
  WgmmaOp op;
  u64 seq = 0;
  long group = -1;  // -1: not committed yet
  float* d[128];
  const u32* a_src[128];
  u32 a[128][4];
  bool has_snap[128];
  std::vector<float> snap;  // 128 x n/2: the accumulators when the snapshot was taken
  // the shared-memory operands as issued: each element's offset and bits (A's first, a_elems of them)
  std::vector<u32> smem_at;
  std::vector<unsigned short> smem_bits;
  size_t a_elems = 0;
};

struct WgState {
  int kind = WG_NONE, arrived = 0;
  u32 arrived_mask[4] = {0, 0, 0, 0};
  bool fenced = false;
  long committed = 0;  // groups committed so far
  u64 issued = 0;      // ops issued so far
  std::deque<WgOp> ops;
};

struct HThread {  // per thread, by linear index
  // mbarrier spinning
  bool spinning = false;
  u32 spin_bar = 0, spin_parity = 0;
  u64 look = ~0ull, stuck = ~0ull;
  // wgmma rendezvous inputs
  int wg_arg = 0;
  float* d = nullptr;
  const u32* a_src = nullptr;
  u32 a[4] = {0, 0, 0, 0};
  WgmmaOp op{};
  // named barrier
  int nbar = -1;
  // bulk async-groups (cp.async.bulk): the thread's reductions in issue order, groups committed
  std::vector<PendingReduce> bulk;
  long bulk_committed = 0;
  // fence.proxy.async since this thread's last named barrier; and whether its last named barrier
  // was passed by threads of which some had not fenced (then it may not issue a bulk reduction)
  bool fenced = false, after_unfenced_bar = false;
  // fence.proxy.async since the async view was last refreshed (refresh_async_view)
  bool fence_unseen = false;
};

using WgmmaComputeFn = std::string (*)(const WgmmaOp&, const u32 (*)[4], float* const*, const unsigned char*,
                                       size_t);

struct Hopper {
  std::unordered_map<u32, MBar> bars;
  std::vector<PendingCopy> copies;  // in issue order
  u64 copy_seq = 0;
  NamedBar nb[16];
  std::vector<WgState> wg;
  std::vector<HThread> th;
  std::vector<std::vector<int>> maxnreg;  // per warp: the setmaxnreg values executed
  // shared memory as the async proxy last saw it (wgmma's operand check; see fence_proxy_async)
  std::vector<unsigned char> async_view;
  int fences_unseen = 0;  // threads whose fence_proxy_async the view has not taken in yet
  u64 epoch = 0;
  int n_spin_queued = 0, n_spin_looked = 0;
  WgmmaComputeFn compute_override = nullptr;  // tests: a stand-in for wgmma_compute (kept across launches)
};
inline Hopper g_hop;

inline HThread& hth(const Thread* t) { return g_hop.th[t->linear]; }

// The async proxy's view of shared memory (the rule is stated at fence_proxy_async): taken anew
// from shared memory, and every thread's fence marked as taken in.
inline void refresh_async_view() {
  memcpy(g_hop.async_view.data(), g_run->dyn_smem, g_hop.async_view.size());
  for (HThread& h : g_hop.th) h.fence_unseen = false;
  g_hop.fences_unseen = 0;
}

// A synchronisation the thread takes part in: the view is refreshed if it fenced since the last one.
inline void refresh_if_fenced(const HThread& h) {
  if (h.fence_unseen) refresh_async_view();
}

// An mbarrier arrive by `self`: the view is refreshed if a thread of its warp fenced since the
// last refresh (one lane writes and fences, __syncwarp, another lane arrives: an elected arrive).
inline void refresh_if_warp_fenced(const Thread* self) {
  const size_t w0 = size_t(self->warp) * 32;
  for (size_t t = w0; t < w0 + 32 && t < g_hop.th.size() && g_hop.fences_unseen; ++t)
    refresh_if_fenced(g_hop.th[t]);
}

// A state change that may let a spinning thread through: every spinner must look again.
inline void bump() {
  ++g_hop.epoch;
  g_hop.n_spin_looked = 0;
}

// Tests: use `f` instead of wgmma_compute (nullptr: back to wgmma_compute). Kept across launches.
inline void set_wgmma_compute_hook(WgmmaComputeFn f) { g_hop.compute_override = f; }

// "0-31, 64, 96-127" for a sorted list of thread indices.
inline std::string ranges(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += j == i ? fmt("%d", v[i]) : fmt("%d-%d", v[i], v[j]);
    i = j + 1;
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Shared-window offsets

inline u32 smem_offset(const void* p) {
  const Run& r = *g_run;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (!(r.dyn_smem && c >= r.dyn_smem && c < r.dyn_smem + r.dyn_size))
    fail(fmt("%s: smem_addr(%p): the pointer is not inside the block's dynamic shared memory (%zu bytes at %p); "
             "in the emulator every shared object that sm_90 instructions address (mbarriers, TMA destinations, "
             "wgmma tiles) must be in dynamic shared memory (BURSTCU_DYNAMIC_SMEM), not static __shared__",
             where(g_cur).c_str(), p, r.dyn_size, static_cast<void*>(r.dyn_smem)));
  return u32(c - r.dyn_smem);
}

inline unsigned char* smem_pointer(u32 off) {
  const Run& r = *g_run;
  if (off >= r.dyn_size)
    fail(fmt("%s: shared offset 0x%x is past the %zu bytes of dynamic shared memory", where(g_cur).c_str(), off,
             r.dyn_size));
  return r.dyn_smem + off;
}

// ---------------------------------------------------------------------------------------------
// mbarriers

inline u64 mbar_word(u32 off, const MBar& b) {  // the checksum kept in the object's 8 bytes
  u64 z = 0x6d62617272696572ull ^ (u64(off) << 40) ^ (b.phase * 0x9E3779B97F4A7C15ull) ^ (u64(b.pending) << 20) ^
          u64(b.count) ^ (u64(b.tx) * 0xBF58476D1CE4E5B9ull);
  z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
  return z ^ (z >> 29);
}

inline void mbar_store(u32 off, const MBar& b) {
  const u64 w = mbar_word(off, b);
  memcpy(g_run->dyn_smem + off, &w, 8);
}

inline std::string mbar_state(u32 off, const MBar& b) {
  return fmt("the mbarrier at shared offset 0x%x is in phase %llu (parity %llu), %u of %u arrivals pending, "
             "tx-count %lld",
             off, b.phase, b.phase & 1, b.pending, b.count, b.tx);
}

// The barrier at `bar` (a pointer from a kernel), checked: inside dynamic smem, 8-byte aligned,
// initialised, its 8 bytes untouched since the last mbarrier operation.
inline MBar& mbar_get(const void* bar, const char* op, u32* off_out) {
  Thread* self = g_cur;
  const u32 off = smem_offset(bar);
  BURSTCU_EMU_CHECK(off % 8 == 0, "%s: %s: mbarrier address (shared offset 0x%x) is not 8-byte aligned",
                    where(self).c_str(), op, off);
  auto it = g_hop.bars.find(off);
  BURSTCU_EMU_CHECK(it != g_hop.bars.end(),
                    "%s: %s on shared offset 0x%x, which holds no initialised mbarrier (mbar_init it first, and "
                    "make every thread wait for the init, e.g. with __syncthreads)",
                    where(self).c_str(), op, off);
  u64 w;
  memcpy(&w, g_run->dyn_smem + off, 8);
  BURSTCU_EMU_CHECK(w == mbar_word(off, it->second),
                    "%s: %s: the 8 bytes of the mbarrier at shared offset 0x%x were overwritten by an ordinary "
                    "store since its last mbarrier operation (PTX ISA: any non-mbarrier operation on an "
                    "initialised mbarrier object is undefined); does a tile overlap the barriers?",
                    where(self).c_str(), op, off);
  *off_out = off;
  return it->second;
}

inline const PendingCopy* copy_signalling(u32 off) {
  for (const PendingCopy& c : g_hop.copies)
    if (c.bar == off) return &c;
  return nullptr;
}

inline std::string thread_name(int linear) { return where(g_pool[linear]); }

// Complete the current phase if its arrivals and bytes are all in.
inline void mbar_maybe_complete(u32 off, MBar& b) {
  if (b.pending != 0 || b.tx != 0) return;
  if (const PendingCopy* c = copy_signalling(off))
    fail(fmt("phase %llu of the mbarrier at shared offset 0x%x completed (all %u arrivals, tx-count 0) while a TMA "
             "copy that signals it is still in flight (%u bytes to shared offset 0x%x, issued by %s): the phase's "
             "expect_tx byte count is smaller than the bytes of its copies (on the GPU the late bytes would count "
             "towards the next phase)",
             b.phase, off, b.count, c->bytes, c->dst, thread_name(c->issuer).c_str()));
  ++b.phase;
  b.pending = b.count;
}

inline void mbar_init(void* bar, u32 count) {
  Thread* self = g_cur;
  const u32 off = smem_offset(bar);
  BURSTCU_EMU_CHECK(off % 8 == 0, "%s: mbar_init: mbarrier address (shared offset 0x%x) is not 8-byte aligned",
                    where(self).c_str(), off);
  BURSTCU_EMU_CHECK(count >= 1 && count <= kCountMax,
                    "%s: mbar_init(shared offset 0x%x, count %u): the count must be in [1, 2^20 - 1] (PTX ISA)",
                    where(self).c_str(), off, count);
  BURSTCU_EMU_CHECK(off + 8 <= g_run->dyn_size, "%s: mbar_init: the mbarrier at shared offset 0x%x ends past the "
                    "%zu bytes of dynamic shared memory", where(self).c_str(), off, g_run->dyn_size);
  if (const PendingCopy* c = copy_signalling(off))
    fail(fmt("%s: mbar_init on the mbarrier at shared offset 0x%x while a TMA copy that signals it is in flight "
             "(%u bytes to shared offset 0x%x, issued by %s)",
             where(self).c_str(), off, c->bytes, c->dst, thread_name(c->issuer).c_str()));
  for (const PendingCopy& c : g_hop.copies)
    BURSTCU_EMU_CHECK(off + 8 <= c.dst || off >= c.dst + c.extent,
                      "%s: mbar_init at shared offset 0x%x: a TMA copy in flight will write those bytes "
                      "(shared offsets 0x%x..0x%x, issued by %s)",
                      where(self).c_str(), off, c.dst, c.dst + c.extent - 1, thread_name(c.issuer).c_str());
  auto it = g_hop.bars.find(off);
  if (it != g_hop.bars.end())
    fail(fmt("%s: mbar_init on the mbarrier at shared offset 0x%x, which is already initialised in this block (%s): "
             "PTX ISA: mbarrier.init on a valid mbarrier object is undefined (it must be invalidated first)",
             where(self).c_str(), off, mbar_state(off, it->second).c_str()));
  MBar b;
  b.count = b.pending = count;
  g_hop.bars[off] = b;
  mbar_store(off, b);
  bump();
}

inline void mbar_arrive(void* bar, u32 expect_tx_bytes) {
  Thread* self = g_cur;
  const char* op = expect_tx_bytes ? "mbar_arrive_expect_tx" : "mbar_arrive";
  u32 off;
  MBar& b = mbar_get(bar, op, &off);
  if (b.pending == 0)
    fail(fmt("%s: %s: an arrival beyond the expected count: %s (the phase has all its arrivals and waits for the "
             "bytes of its copies, which land once a thread waits on the barrier)",
             where(self).c_str(), op, mbar_state(off, b).c_str()));
  const long long tx = b.tx + (long long)expect_tx_bytes;
  if (tx > kTxMax)
    fail(fmt("%s: %s(%u bytes): tx-count overflow: %s, and the PTX ISA limit is 2^20 - 1", where(self).c_str(), op,
             expect_tx_bytes, mbar_state(off, b).c_str()));
  b.tx = tx;  // expect-tx first, then the arrive-on (PTX ISA, mbarrier.arrive.expect_tx)
  --b.pending;
  refresh_if_warp_fenced(self);
  mbar_maybe_complete(off, b);
  mbar_store(off, b);
  bump();
  if ((g_run->flags & EMU_RANDOMIZE) && next_random() % 2 == 0) {
    // randomising: half the time the others run before the arriving thread goes on (what the
    // arrival released, e.g. a producer's copy into a stage the arriving thread's products still
    // read, may happen first)
    enqueue(self);
    yield_to_next();
  }
}

inline void mbar_complete_tx(const PendingCopy& c) {
  auto it = g_hop.bars.find(c.bar);
  if (it == g_hop.bars.end())  // cannot happen: barriers are never invalidated within a block
    fail(fmt("a TMA copy issued by %s completes on shared offset 0x%x, which holds no mbarrier",
             thread_name(c.issuer).c_str(), c.bar));
  MBar& b = it->second;
  u64 w;
  memcpy(&w, g_run->dyn_smem + c.bar, 8);
  if (w != mbar_word(c.bar, b))
    fail(fmt("a TMA copy issued by %s completes on the mbarrier at shared offset 0x%x, whose 8 bytes were "
             "overwritten by an ordinary store since its last mbarrier operation",
             thread_name(c.issuer).c_str(), c.bar));
  const long long tx = b.tx - (long long)c.bytes;
  if (tx < -kTxMax)
    fail(fmt("a TMA copy of %u bytes (issued by %s) underflows the tx-count of the mbarrier at shared offset 0x%x: "
             "%s; the PTX ISA range is [-(2^20 - 1), 2^20 - 1]",
             c.bytes, thread_name(c.issuer).c_str(), c.bar, mbar_state(c.bar, b).c_str()));
  b.tx = tx;
  mbar_maybe_complete(c.bar, b);
  mbar_store(c.bar, b);
  bump();
}

// ---------------------------------------------------------------------------------------------
// Bulk tensor copies

inline std::string check_map(const EmuTensorMap& m) {
  if (m.magic != kTensorMapMagic)
    return fmt("its magic is 0x%016llx, not 0x%016llx: not an emulator tensor map (burstcu/ops/cuda/tensor_map.py, "
               "backend \"emulated\")", m.magic, kTensorMapMagic);
  if (m.rank < 1 || m.rank > 5) return fmt("rank %u is not in 1..5", m.rank);
  const u32 eb = m.elem_bytes;
  if (eb != 1 && eb != 2 && eb != 4 && eb != 8) return fmt("elem_bytes %u is not 1, 2, 4 or 8", eb);
  if (m.swizzle > 3) return fmt("swizzle %u is not a CUtensorMapSwizzle value 0..3 (none, 32B, 64B, 128B)", m.swizzle);
  if (m.base % 16) return fmt("the global address 0x%llx is not 16-byte aligned", m.base);
  for (u32 i = 0; i < 5; ++i) {
    if (i >= m.rank) {
      if (m.dims[i] != 1 || m.box[i] != 1)
        return fmt("dim %u is unused (rank %u) but has size %llu and box %u (both must be 1)", i, m.rank, m.dims[i],
                   m.box[i]);
      continue;
    }
    if (m.dims[i] < 1 || m.dims[i] > (1ull << 32)) return fmt("dims[%u] = %llu is not in 1..2^32", i, m.dims[i]);
    if (m.box[i] < 1 || m.box[i] > 256) return fmt("box[%u] = %u is not in 1..256", i, m.box[i]);
    if (i == 0 && m.strides[0] != eb)
      return fmt("strides[0] = %llu must equal elem_bytes %u (dim 0 is contiguous)", m.strides[0], eb);
    if (i > 0 && (m.strides[i] % 16 || m.strides[i] >= (1ull << 40)))
      return fmt("strides[%u] = %llu bytes is not a multiple of 16 below 2^40", i, m.strides[i]);
  }
  const u32 inner = m.box[0] * eb, span = swizzle_span(m.swizzle);
  if (inner % 16) return fmt("the box's inner dimension is %u bytes, not a multiple of 16", inner);
  if (span && inner > span)
    return fmt("the box's inner dimension is %u bytes, more than the %u-byte swizzle span", inner, span);
  return "";
}

// The shared bytes between consecutive rows (dim 0) of a landed box: the row itself without
// swizzle; under a swizzle, at least the span, since the copy engine gives a row narrower than the
// span a span of its own (seen on an H200: a 64-byte row under the 128-byte swizzle lands in the
// first 64 bytes' chunks of a 128-byte line, XORed by that line's index, the rest untouched).
inline u32 row_pitch(u32 row_bytes, u32 span) { return span ? std::max(row_bytes, span) : row_bytes; }

// The shared bytes a box may touch from its (aligned) destination: rows at `row_pitch`, rounded up
// to the swizzle span, since the XOR moves 16-byte chunks within a span-sized segment.
inline u32 box_extent(const EmuTensorMap& m) {
  const u32 span = swizzle_span(m.swizzle);
  u64 bytes = row_pitch(m.box[0] * m.elem_bytes, span);
  for (u32 i = 1; i < m.rank; ++i) bytes *= m.box[i];
  return span ? u32((bytes + span - 1) / span * span) : u32(bytes);
}

// The checks every bulk tensor operation `op` makes ("tma_load", "tma_reduce_add"): its tensor map
// (64-byte aligned, valid, of `rank`; copied to *m), its shared side `smem` ("destination" or
// "source": aligned to where the swizzle pattern repeats, the box's *extent bytes inside dynamic
// shared memory) and coordinate 0 on 16 bytes of global memory. Returns the shared offset.
inline u32 checked_box(const char* op, const char* side, const void* map, const void* smem, const int* coords,
                       int rank, EmuTensorMap* m, u32* extent) {
  Thread* self = g_cur;
  BURSTCU_EMU_CHECK((reinterpret_cast<uintptr_t>(map) & 63) == 0,
                    "%s: %s: the tensor map at %p is not 64-byte aligned (cuTensorMapEncodeTiled requires it)",
                    where(self).c_str(), op, map);
  memcpy(m, map, sizeof(EmuTensorMap));
  const std::string bad = check_map(*m);
  if (!bad.empty()) fail(fmt("%s: %s: the tensor map at %p is invalid: %s", where(self).c_str(), op, map, bad.c_str()));
  BURSTCU_EMU_CHECK(int(m->rank) == rank, "%s: %s: a %d-d operation with a tensor map of rank %u", where(self).c_str(),
                    op, rank, m->rank);
  const u32 off = smem_offset(smem), span = swizzle_span(m->swizzle);
  const u32 align = span ? span * 8 : 128;  // 256, 512, 1024: where the swizzle pattern repeats
  BURSTCU_EMU_CHECK(off % align == 0,
                    "%s: %s: %s shared offset 0x%x is not %u-byte aligned (a bulk tensor operation's shared side is "
                    "128-byte aligned, and a swizzled one starts at its pattern's 256 / 512 / 1024-byte boundary, "
                    "which the wgmma descriptors' base offset 0 assumes)",
                    where(self).c_str(), op, side, off, align);
  *extent = box_extent(*m);
  BURSTCU_EMU_CHECK(u64(off) + *extent <= g_run->dyn_size,
                    "%s: %s: the box (%u bytes of shared memory at offset 0x%x) ends past the %zu bytes of dynamic "
                    "shared memory", where(self).c_str(), op, *extent, off, g_run->dyn_size);
  if ((coords[0] * (long long)m->elem_bytes) % 16 != 0)
    fail(fmt("%s: %s: coordinate %d along dim 0 puts the box at a global address that is not 16-byte aligned (PTX "
             "ISA, Tensors: the bounding box's address must be 16-byte aligned)", where(self).c_str(), op, coords[0]));
  return off;
}

inline void tma_load(void* dst, const void* map, void* bar, const int* coords, int rank) {
  Thread* self = g_cur;
  PendingCopy c;
  const u32 off = checked_box("tma_load", "destination", map, dst, coords, rank, &c.map, &c.extent);
  const EmuTensorMap& m = c.map;
  u64 bytes = m.elem_bytes;
  for (u32 i = 0; i < m.rank; ++i) bytes *= m.box[i];
  BURSTCU_EMU_CHECK(bytes <= u64(kTxMax),
                    "%s: tma_load: a box of %llu bytes exceeds the mbarrier tx-count limit 2^20 - 1",
                    where(self).c_str(), bytes);
  c.dst = off;
  c.bytes = u32(bytes);
  u32 bar_off;
  mbar_get(bar, "tma_load", &bar_off);
  c.bar = bar_off;
  for (const auto& kv : g_hop.bars)
    BURSTCU_EMU_CHECK(kv.first + 8 <= off || kv.first >= off + c.extent,
                      "%s: tma_load: the box (shared offsets 0x%x..0x%x) would overwrite the mbarrier at shared "
                      "offset 0x%x", where(self).c_str(), off, off + c.extent - 1, kv.first);
  for (const PendingCopy& o : g_hop.copies)
    BURSTCU_EMU_CHECK(o.dst + o.extent <= off || o.dst >= off + c.extent,
                      "%s: tma_load into shared offsets 0x%x..0x%x while a copy into 0x%x..0x%x (issued by %s, "
                      "signalling the mbarrier at 0x%x) is still in flight: nobody has waited on its barrier yet (a "
                      "consumer that skips its full-barrier wait, or a producer that skips the stage's empty-barrier "
                      "wait?)",
                      where(self).c_str(), off, off + c.extent - 1, o.dst, o.dst + o.extent - 1,
                      thread_name(o.issuer).c_str(), o.bar);
  for (const HThread& h : g_hop.th)
    for (const PendingReduce& p : h.bulk)
      BURSTCU_EMU_CHECK(p.read || p.src + p.extent <= off || p.src >= off + c.extent,
                        "%s: tma_load into shared offsets 0x%x..0x%x, the source of a bulk tensor reduction not yet "
                        "waited for (bulk_wait_group_read)", where(self).c_str(), off, off + c.extent - 1);
  for (int i = 0; i < 5; ++i) c.coords[i] = i < rank ? coords[i] : 0;
  c.issuer = self->linear;
  c.seq = ++g_hop.copy_seq;
  g_hop.copies.push_back(c);
  bump();
}

// Dim 0 of a box at coordinate c0: its elements inside the tensor are [lo, hi) (lo >= hi: none).
inline void inner_range(const EmuTensorMap& m, long long c0, long long* lo, long long* hi) {
  *lo = std::max(0ll, -c0);
  *hi = std::min((long long)m.box[0], (long long)m.dims[0] - c0);
}

// Row r of a box at `coords` (its dims 1..4, dim 1 fastest): whether it lies inside the tensor,
// and then the byte offset of its element 0 of dim 0 in global memory (at *offset).
inline bool box_row_at(const EmuTensorMap& m, const int* coords, u64 r, u64* offset) {
  u64 at = 0, rest = r;
  for (int k = 1; k < 5; ++k) {
    const long long i = (long long)(rest % m.box[k]);
    rest /= m.box[k];
    const long long g = (long long)coords[k] + i;
    if (g < 0 || g >= (long long)m.dims[k]) return false;
    at += u64(g) * m.strides[k];
  }
  *offset = at;
  return true;
}

// Write the box of copy `c` into shared memory (reading global memory now).
inline void land_bytes(const PendingCopy& c) {
  const EmuTensorMap& m = c.map;
  const u32 eb = m.elem_bytes, span = swizzle_span(m.swizzle);
  const u32 row_bytes = m.box[0] * eb, pitch = row_pitch(row_bytes, span);
  const u64 rows = u64(m.box[1]) * m.box[2] * m.box[3] * m.box[4];
  unsigned char row[256 * 8];
  const unsigned char* base = reinterpret_cast<const unsigned char*>(uintptr_t(m.base));
  const long long c0 = c.coords[0];
  long long lo, hi;
  inner_range(m, c0, &lo, &hi);
  for (u64 r = 0; r < rows; ++r) {
    memset(row, 0, row_bytes);
    u64 src = 0;
    if (lo < hi && box_row_at(m, c.coords, r, &src))
      memcpy(row + lo * eb, base + src + u64(c0 + lo) * eb, size_t(hi - lo) * eb);
    const u64 at = c.dst + r * pitch;
    for (u32 j = 0; j < row_bytes; j += 16) {
      const u64 to = swizzle_address(at + j, span);
      memcpy(g_run->dyn_smem + to, row + j, 16);
      memcpy(g_hop.async_view.data() + to, row + j, 16);  // written by the async proxy itself
    }
  }
}

// Land pending copy number i: its bytes, then complete_tx on its barrier.
inline void land(size_t i) {
  const PendingCopy c = g_hop.copies[i];
  g_hop.copies.erase(g_hop.copies.begin() + long(i));
  land_bytes(c);
  mbar_complete_tx(c);
}

// Rule (a): the copies that signal the barrier at `off`, in issue order.
inline void land_for_barrier(u32 off) {
  for (size_t i = 0; i < g_hop.copies.size();) {
    if (g_hop.copies[i].bar == off)
      land(i);
    else
      ++i;
  }
}

// One memory, one proxy: nothing to order. The fence is recorded for two checks: tma_reduce_add's
// (below) and wgmma's shared operands (wg_record_operand), which compare each element with the
// async proxy's view of shared memory: the bytes TMA copies landed, and what generic-proxy writes
// had made of the rest when the view was last refreshed. The view is refreshed (from shared memory
// as it is then) when a synchronisation completes that a thread which fenced since the last
// refresh takes part in: a __syncthreads, a named barrier's phase, an mbarrier arrive by it or by
// a thread of its warp, or a wgmma its warpgroup issues. An operand element that differs from the
// view was written by ordinary stores with no fence.proxy.async, on a path the emulator follows,
// between them and the wgmma (PTX ISA: wgmma reads shared memory through the async proxy; the
// generic proxy's writes must be fenced first) — an error. A proxy for the rule, not the rule: it
// does not see which thread wrote what, nor when: a fence by any thread taking part in the
// synchronisation takes in every write made before the synchronisation, so a fence placed before
// the writes of the same round is not caught; a missing fence is.
inline void fence_proxy_async() {
  HThread& h = hth(g_cur);
  h.fenced = true;
  g_hop.fences_unseen += !h.fence_unseen;
  h.fence_unseen = true;
}

// ---------------------------------------------------------------------------------------------
// Bulk tensor reductions (cp.reduce.async.bulk.tensor ... .add, bulk_group)
//
// tma_reduce_add checks the map and the shared source as tma_load checks a copy, then records the
// reduction (and a copy of its source) in the issuing thread's open bulk async-group;
// bulk_commit_group closes that group; bulk_wait_group(N) takes, in issue order, every reduction of
// the thread's committed groups but the N most recent: the bytes of the source it reads must be
// those of its issue (the hardware may read them at any time up to this wait: a source rewritten
// before it is an error), and for wait_group (not .read) it adds each float of the box, as issued,
// into global memory (elements outside the tensor are skipped); reductions only read by a .read
// wait are written at a later full wait or at the thread's exit. A thread that exits with
// reductions not waited for is an error. A named barrier whose arrivals did not all
// fence_proxy_async since their barrier before makes the next tma_reduce_add of a thread that
// passed it an error (a proxy for the ISA's rule that the writes be fenced before the issue: see
// fence_proxy_async above). A tma_load into the source of a reduction not yet read is an error.

inline void tma_reduce_add(const void* map, const void* src, const int* coords, int rank) {
  Thread* self = g_cur;
  const Run& r = *g_run;
  PendingReduce p;
  const u32 off = checked_box("tma_reduce_add", "source", map, src, coords, rank, &p.map, &p.extent);
  BURSTCU_EMU_CHECK(p.map.elem_bytes == 4, "%s: tma_reduce_add: elements of %u bytes: the emulator adds float32 only",
                    where(self).c_str(), p.map.elem_bytes);
  p.src = off;
  for (int i = 0; i < rank; ++i)
    BURSTCU_EMU_CHECK(coords[i] >= 0, "%s: tma_reduce_add: coordinate %d along dim %d is negative (PTX ISA: a "
                      "shared-to-global tensor operation starts at non-negative coordinates)", where(self).c_str(),
                      coords[i], i);
  for (const auto& kv : g_hop.bars)
    BURSTCU_EMU_CHECK(kv.first + 8 <= off || kv.first >= off + p.extent,
                      "%s: tma_reduce_add: its source (shared offsets 0x%x..0x%x) holds the mbarrier at 0x%x",
                      where(self).c_str(), off, off + p.extent - 1, kv.first);
  for (const PendingCopy& o : g_hop.copies)
    BURSTCU_EMU_CHECK(o.dst + o.extent <= off || o.dst >= off + p.extent,
                      "%s: tma_reduce_add from shared offsets 0x%x..0x%x while a bulk copy into 0x%x..0x%x is in "
                      "flight (nobody has waited on its barrier)", where(self).c_str(), off, off + p.extent - 1,
                      o.dst, o.dst + o.extent - 1);
  BURSTCU_EMU_CHECK(!hth(self).after_unfenced_bar,
                    "%s: tma_reduce_add after a named barrier that threads passed without fence_proxy_async "
                    "since their barrier before: the generic-proxy writes of its source are not ordered before "
                    "the bulk operation's async-proxy reads (PTX ISA: fence.proxy.async)", where(self).c_str());
  for (int i = 0; i < 5; ++i) p.coords[i] = i < rank ? coords[i] : 0;
  p.source.assign(r.dyn_smem + off, r.dyn_smem + off + p.extent);
  hth(self).bulk.push_back(p);
  ++g_global_adds[2];
}

// Whether a byte that reduction p reads (its box's rows, swizzled; not the rest of its extent)
// differs from the same byte at its issue.
inline bool source_changed(const PendingReduce& p) {
  const EmuTensorMap& m = p.map;
  const u32 span = swizzle_span(m.swizzle), row_bytes = m.box[0] * m.elem_bytes;
  const u32 pitch = row_pitch(row_bytes, span);
  const u64 rows = u64(m.box[1]) * m.box[2] * m.box[3] * m.box[4];
  for (u64 r = 0; r < rows; ++r)
    for (u32 j = 0; j < row_bytes; j += 16) {
      const u64 at = swizzle_address(p.src + r * pitch + j, span);
      if (memcmp(p.source.data() + (at - p.src), g_run->dyn_smem + at, 16) != 0) return true;
    }
  return false;
}

// Global += the shared image of reduction p as it was at its issue (p.source; land_bytes in the
// other direction, adding floats).
inline void reduce_bytes(const PendingReduce& p) {
  const EmuTensorMap& m = p.map;
  const u32 span = swizzle_span(m.swizzle);
  const u32 row_bytes = m.box[0] * 4, pitch = row_pitch(row_bytes, span);
  const u64 rows = u64(m.box[1]) * m.box[2] * m.box[3] * m.box[4];
  float row[256];
  unsigned char* base = reinterpret_cast<unsigned char*>(uintptr_t(m.base));
  const long long c0 = p.coords[0];
  long long lo, hi;
  inner_range(m, c0, &lo, &hi);
  for (u64 r = 0; r < rows; ++r) {
    u64 dst = 0;
    if (lo >= hi || !box_row_at(m, p.coords, r, &dst)) continue;
    const u64 at = p.src + r * pitch;  // the source as issued (p.source), swizzled from p.src
    for (u32 j = 0; j < row_bytes; j += 16)
      memcpy(reinterpret_cast<unsigned char*>(row) + j, p.source.data() + (swizzle_address(at + j, span) - p.src), 16);
    float* out = reinterpret_cast<float*>(base + dst) + c0;
    for (long long e = lo; e < hi; ++e) out[e] += row[e];
  }
}

inline void bulk_commit_group() {  // an empty group is a group too (PTX ISA), counted by the waits
  HThread& h = hth(g_cur);
  ++h.bulk_committed;
  for (PendingReduce& p : h.bulk)
    if (p.group < 0) p.group = h.bulk_committed;
}

// wait_group (read_only false) / wait_group.read (true) N: the thread's committed groups but the N
// most recent are read (their source compared with the issue's: a change is an error) and, unless
// read_only, their adds are written too; a read one is written at a later full wait or the exit.
inline void bulk_wait_group(int n, bool read_only) {
  HThread& h = hth(g_cur);
  std::vector<PendingReduce> keep;
  for (PendingReduce& p : h.bulk) {
    if (p.group < 0 || p.group > h.bulk_committed - n) {
      keep.push_back(std::move(p));
      continue;
    }
    if (!p.read && source_changed(p))
      fail(fmt("%s: the shared source of a bulk tensor reduction (offsets 0x%x..0x%x) changed between its issue "
               "and the bulk_wait_group(_read) that retires it", where(g_cur).c_str(), p.src, p.src + p.extent - 1));
    p.read = true;
    if (read_only)
      keep.push_back(std::move(p));
    else
      reduce_bytes(p);
  }
  h.bulk.swap(keep);
}

// red.global.add.v2.f32: two floats added to the 8 bytes at dst, each element atomically; the ISA
// requires the address aligned to the vector's 8 bytes, so a misaligned one fails here.
inline void red_add_v2(float* dst, float a, float b) {
  BURSTCU_EMU_CHECK((reinterpret_cast<uintptr_t>(dst) & 7) == 0,
                    "%s: red.global.add.v2.f32 address %p is not 8-byte aligned", where(g_cur).c_str(),
                    static_cast<void*>(dst));
  dst[0] += a;  // fibers switch only at synchronisation points: each add is atomic
  dst[1] += b;
  ++g_global_adds[1];
}

// ---------------------------------------------------------------------------------------------
// Waiting on mbarriers

inline bool mbar_test(const void* bar, u32 parity, u32* off) {
  Thread* self = g_cur;
  MBar* b = &mbar_get(bar, "mbar_try_wait", off);
  BURSTCU_EMU_CHECK(parity <= 1, "%s: mbar_try_wait: parity %u is not 0 or 1", where(self).c_str(), parity);
  if ((b->phase & 1) != parity) return true;
  if (!copy_signalling(*off)) return false;
  land_for_barrier(*off);
  b = &g_hop.bars[*off];
  return (b->phase & 1) != parity;
}

// Every queued thread is a spinner that failed at the current epoch (and the caller just did).
inline bool all_stuck() {
  return g_run->q_count == size_t(g_hop.n_spin_queued) && g_hop.n_spin_looked == g_hop.n_spin_queued;
}

// Rule (b): land one copy (the oldest; a random one when randomising). False if none is pending.
inline bool land_for_progress() {
  if (g_hop.copies.empty()) return false;
  land((g_run->flags & EMU_RANDOMIZE) ? size_t(next_random() % g_hop.copies.size()) : 0);
  return true;
}

// After a failed look at the barrier at `off`: yield (or land a copy, or report a deadlock).
inline void spin_after_failed_look(u32 off, u32 parity, bool looping) {
  Thread* self = g_cur;
  HThread& h = hth(self);
  h.spinning = true;
  h.spin_bar = off;
  h.spin_parity = parity;
  h.look = g_hop.epoch;
  if (all_stuck()) {
    if (land_for_progress()) return;  // something changed: the caller looks again
    if (looping || h.stuck == g_hop.epoch) {
      self->state = S_SPIN;
      fail(describe_deadlock());
    }
    h.stuck = g_hop.epoch;
  }
  enqueue(self);
  self->state = S_SPIN;
  ++g_hop.n_spin_queued;
  ++g_hop.n_spin_looked;
  yield_to_next();
  --g_hop.n_spin_queued;
  if (h.look == g_hop.epoch) --g_hop.n_spin_looked;
}

inline bool mbar_try_wait(void* bar, u32 parity) {
  u32 off;
  if (mbar_test(bar, parity, &off)) {
    hth(g_cur).spinning = false;
    return true;
  }
  spin_after_failed_look(off, parity, false);
  return false;
}

inline void mbar_wait(void* bar, u32 parity) {
  u32 off;
  while (!mbar_test(bar, parity, &off)) spin_after_failed_look(off, parity, true);
  hth(g_cur).spinning = false;
}

// ---------------------------------------------------------------------------------------------
// elect.sync, named barriers, setmaxnreg: warp collectives (emu_runtime.h's collective())

inline bool elect_one() {
  collective(K_ELECT, 0xffffffffu);
  return g_cur->outv != 0;
}

inline long nbar_arg(int id, int n, bool sync) { return long(id) | (long(sync) << 4) | (long(n) << 5); }
inline std::string nbar_name(long arg) {
  return fmt("%s %ld, %ld", (arg >> 4 & 1) ? "bar.sync" : "bar.arrive", arg & 15, arg >> 5);
}

inline void named_barrier(int id, int nthreads, bool sync) {
  Thread* self = g_cur;
  Run& r = *g_run;
  const char* op = sync ? "named_bar_sync" : "named_bar_arrive";
  BURSTCU_EMU_CHECK(id >= 0 && id < 16, "%s: %s: barrier id %d is not in 0..15", where(self).c_str(), op, id);
  BURSTCU_EMU_CHECK(nthreads > 0 && nthreads % 32 == 0, "%s: %s(%d, %d): the thread count must be a positive "
                    "multiple of 32 (the warp size)", where(self).c_str(), op, id, nthreads);
  BURSTCU_EMU_CHECK(nthreads <= int(r.warps.size()) * 32, "%s: %s(%d, %d): the block has only %zu warps, so the "
                    "barrier can never complete", where(self).c_str(), op, id, nthreads, r.warps.size());
  BURSTCU_EMU_CHECK(!(id == 0 && r.bar_waiting > 0), "%s: %s on barrier 0 while %d thread(s) wait at __syncthreads "
                    "(also barrier 0)", where(self).c_str(), op, r.bar_waiting);
  self->arg = nbar_arg(id, nthreads, sync);
  g_hop.nb[id].unfenced += !hth(self).fenced;
  g_hop.nb[id].fence_unseen |= hth(self).fence_unseen;
  hth(self).fenced = false;
  const Warp& w = r.warps[self->warp];
  collective(K_NAMED_BAR, w.exist & ~w.exited);
  if (!sync) return;
  const u64 gen = self->outv;
  NamedBar& b = g_hop.nb[id];
  while (b.gen == gen) {
    hth(self).nbar = id;
    b.waiters.push_back(self);
    self->state = S_NBAR;
    yield_to_next();
  }
  hth(self).nbar = -1;
  hth(self).after_unfenced_bar = b.unfenced_at[gen] > 0;  // the phase it passed (gen: its number)
}

inline void setmaxnreg(int n) {
  Thread* self = g_cur;
  BURSTCU_EMU_CHECK(n >= 24 && n <= 256 && n % 8 == 0,
                    "%s: setmaxnreg %d: the register count must be in [24, 256] and a multiple of 8 (PTX ISA)",
                    where(self).c_str(), n);
  const int g = self->warp / 4;
  BURSTCU_EMU_CHECK(size_t(g) < g_hop.wg.size(),
                    "%s: setmaxnreg: its warpgroup %d is incomplete (the block has %d threads); setmaxnreg is "
                    ".aligned over the 128 threads of a warpgroup", where(self).c_str(), g, g_run->nthreads);
  self->arg = n;
  const Warp& w = g_run->warps[self->warp];
  collective(K_SETMAXNREG, w.exist & ~w.exited);
}

inline void compute_hopper_collective(int warp, const Group& grp) {
  int first = -1;
  for (int l = 0; l < 32; ++l)
    if (grp.mask >> l & 1u) {
      first = l;
      break;
    }
  Thread* t0 = lane_thread(warp, first);
  if (grp.kind == K_ELECT) {
    for (int l = 0; l < 32; ++l)
      if (grp.mask >> l & 1u) lane_thread(warp, l)->outv = (l == first);
    return;
  }
  for (int l = first + 1; l < 32; ++l) {
    if (!(grp.mask >> l & 1u)) continue;
    const Thread* t = lane_thread(warp, l);
    if (t->arg == t0->arg) continue;
    if (grp.kind == K_NAMED_BAR)
      fail(fmt("divergent named barrier in warp %d: lane %d is at %s while lane %d is at %s (bar is .aligned: the "
               "whole warp executes the same one)",
               warp, first, nbar_name(t0->arg).c_str(), l, nbar_name(t->arg).c_str()));
    fail(fmt("warp %d: lane %d executed setmaxnreg %ld while lane %d executed setmaxnreg %ld", warp, first, t0->arg,
             l, t->arg));
  }
  if (grp.kind == K_SETMAXNREG) {
    std::vector<int>& mine = g_hop.maxnreg[warp];
    const size_t k = mine.size();
    mine.push_back(int(t0->arg));
    for (int w = warp / 4 * 4; w < warp / 4 * 4 + 4; ++w)
      if (w != warp && g_hop.maxnreg[w].size() > k && g_hop.maxnreg[w][k] != int(t0->arg))
        fail(fmt("warps %d and %d of warpgroup %d executed different setmaxnreg instructions (setmaxnreg %d and %d, "
                 "their setmaxnreg number %zu): all warps of a warpgroup must execute the same one (PTX ISA)",
                 w, warp, warp / 4, g_hop.maxnreg[w][k], int(t0->arg), k + 1));
    return;
  }
  // K_NAMED_BAR: the warp arrives
  const int id = int(t0->arg & 15), n = int(t0->arg >> 5);
  NamedBar& b = g_hop.nb[id];
  if (b.arrived == 0)
    b.expected = n;
  else if (b.expected != n)
    fail(fmt("warp %d reached %s while barrier %d's current phase was started with a count of %d threads", warp,
             nbar_name(t0->arg).c_str(), id, b.expected));
  if (b.warps >> warp & 1u)
    fail(fmt("warp %d reached %s a second time before barrier %d completed (%d of %d threads arrived): PTX ISA: a "
             "warp must not execute bar.arrive followed by another bar on the same barrier before it resets",
             warp, nbar_name(t0->arg).c_str(), id, b.arrived, b.expected));
  b.warps |= 1u << warp;
  b.arrived += 32;
  for (int l = 0; l < 32; ++l)
    if (grp.mask >> l & 1u) lane_thread(warp, l)->outv = b.gen;
  if (b.arrived >= b.expected) {
    if (b.fence_unseen) refresh_async_view();
    b.fence_unseen = false;
    b.unfenced_at[b.gen] = b.unfenced;
    ++b.gen;
    b.arrived = 0;
    b.warps = 0;
    b.unfenced = 0;
    std::vector<Thread*> released;
    released.swap(b.waiters);
    enqueue_all(released.data(), int(released.size()));
  }
}

// ---------------------------------------------------------------------------------------------
// wgmma: warpgroup rendezvous and deferred execution

inline std::string wg_threads(int g) { return fmt("threads %d-%d", 128 * g, 128 * g + 127); }

inline void wg_check_op(int g) {
  const HThread& h0 = g_hop.th[128 * g];
  for (int i = 0; i < 128; ++i) {
    const HThread& h = g_hop.th[128 * g + i];
    const WgmmaOp &a = h0.op, &b = h.op;
    if (a.n != b.n || a.elem != b.elem || a.a_in_regs != b.a_in_regs || a.desc_a != b.desc_a ||
        a.desc_b != b.desc_b || a.trans_a != b.trans_a || a.trans_b != b.trans_b || a.scale_d != b.scale_d)
      fail(fmt("warpgroup %d: %s and %s issued wgmma with different operands (n %d/%d, a_in_regs %d/%d, desc_a "
               "0x%llx/0x%llx, desc_b 0x%llx/0x%llx, trans %d%d/%d%d, scale_d %d/%d): all 128 threads must pass the "
               "same descriptors and flags",
               g, thread_name(128 * g).c_str(), thread_name(128 * g + i).c_str(), a.n, b.n, a.a_in_regs, b.a_in_regs,
               a.desc_a, b.desc_a, a.desc_b, b.desc_b, a.trans_a, a.trans_b, b.trans_a, b.trans_b, a.scale_d,
               b.scale_d));
    if (!h.d) fail(fmt("%s issued wgmma with a null accumulator pointer", thread_name(128 * g + i).c_str()));
  }
}

// Snapshot thread t's accumulators for op `o` (n/2 floats).
inline void wg_snap(WgOp& o, int t) {
  const int half = o.op.n / 2;
  if (o.snap.empty()) o.snap.resize(size_t(128) * half);
  memcpy(&o.snap[size_t(t) * half], o.d[t], sizeof(float) * half);
  o.has_snap[t] = true;
}

// Record the shared-memory operand `desc` (rows x 16 elements) of op `o` as it is now: each element's
// offset and bits. A descriptor that does not decode, or an element past shared memory, records
// nothing there (wgmma_compute reports it when the op executes). An element that differs from the
// async proxy's view (fence_proxy_async) is an error.
inline void wg_record_operand(WgOp& o, u64 desc, bool mn_major, int rows, int g, const char* which) {
  using namespace wgmma_detail;
  Desc d;
  if (!decode(desc, "", &d).empty()) return;
  for (int mn = 0; mn < rows; ++mn)
    for (int k = 0; k < 16; ++k) {
      const u64 addr = swizzle(element_address(d, mn_major, mn, k), d.swizzle);
      if (addr + 2 > g_run->dyn_size) continue;
      unsigned short bits, seen;
      memcpy(&bits, g_run->dyn_smem + addr, 2);
      memcpy(&seen, g_hop.async_view.data() + addr, 2);
      if (bits != seen)
        fail(fmt("warpgroup %d (%s) issued a wgmma whose %s operand in shared memory (offset 0x%llx: 0x%04x) was "
                 "written by ordinary stores with no fence_proxy_async between them and the wgmma on a path the "
                 "emulator follows (fence, then __syncthreads, a named barrier, an mbarrier arrive by the warp, or "
                 "the wgmma of the fencing thread's warpgroup; the async proxy last saw 0x%04x there): wgmma reads "
                 "shared memory through the async proxy, and the generic "
                 "proxy's writes must be ordered before it by fence.proxy.async (PTX ISA, memory consistency: "
                 "proxies), then a synchronisation with the issuing warpgroup",
                 g, wg_threads(g).c_str(), which, (unsigned long long)addr, bits, seen));
      o.smem_at.push_back(u32(addr));
      o.smem_bits.push_back(bits);
    }
}

inline void wg_issue_op(int g, WgState& W) {
  if (!W.fenced)
    fail(fmt("warpgroup %d (%s) issued wgmma without a wgmma_fence since its last wgmma_wait (or its start): the PTX "
             "ISA requires wgmma.fence before the first mma_async and between register accesses and an mma_async "
             "that uses those registers; the emulator requires one after every wait_group (slightly stricter)",
             g, wg_threads(g).c_str()));
  wg_check_op(g);
  W.ops.emplace_back();
  WgOp& o = W.ops.back();
  o.op = g_hop.th[128 * g].op;
  o.seq = ++W.issued;
  for (int t = 0; t < 128; ++t) {
    const HThread& h = g_hop.th[128 * g + t];
    o.d[t] = h.d;
    o.a_src[t] = h.a_src;
    memcpy(o.a[t], h.a, sizeof o.a[t]);
    o.has_snap[t] = false;
  }
  for (int t = 0; t < 128 && g_hop.fences_unseen; ++t) refresh_if_fenced(g_hop.th[128 * g + t]);
  if (!o.op.a_in_regs) wg_record_operand(o, o.op.desc_a, o.op.trans_a == 1, 64, g, "A");
  o.a_elems = o.smem_at.size();
  wg_record_operand(o, o.op.desc_b, o.op.trans_b == 1, o.op.n, g, "B");
  for (int t = 0; t < 128; ++t) {
    bool earlier = false;
    for (size_t k = 0; k + 1 < W.ops.size() && !earlier; ++k) earlier = W.ops[k].d[t] == o.d[t];
    if (!earlier) wg_snap(o, t);
  }
}

inline void wg_execute_front(int g, WgState& W) {
  WgOp& o = W.ops.front();
  const int half = o.op.n / 2;
  for (int t = 0; t < 128; ++t) {
    if (o.has_snap[t] && memcmp(&o.snap[size_t(t) * half], o.d[t], sizeof(float) * half) != 0) {
      int i = 0;
      while (memcmp(&o.snap[size_t(t) * half + i], o.d[t] + i, sizeof(float)) == 0) ++i;
      fail(fmt("%s changed accumulator register d[%d] (from %g to %g) of a wgmma (op %llu of warpgroup %d) while it "
               "was in flight: between its issue and the wgmma_wait that retires it, the accumulators belong to "
               "the tensor core (PTX ISA: accessing them before wait_group is undefined)",
               thread_name(128 * g + t).c_str(), i, double(o.snap[size_t(t) * half + i]), double(o.d[t][i]),
               o.seq, g));
    }
    if (o.op.a_in_regs && memcmp(o.a_src[t], o.a[t], sizeof o.a[t]) != 0)
      fail(fmt("%s changed the A-fragment registers of a wgmma_rs (op %llu of warpgroup %d) while it was in flight "
               "(0x%08x 0x%08x 0x%08x 0x%08x at issue, 0x%08x 0x%08x 0x%08x 0x%08x now): keep the A fragment array "
               "unmodified (and alive) until the wgmma_wait that retires the op",
               thread_name(128 * g + t).c_str(), o.seq, g, o.a[t][0], o.a[t][1], o.a[t][2], o.a[t][3],
               o.a_src[t][0], o.a_src[t][1], o.a_src[t][2], o.a_src[t][3]));
  }
  for (size_t i = 0; i < o.smem_at.size(); ++i) {
    unsigned short now;
    memcpy(&now, g_run->dyn_smem + o.smem_at[i], 2);
    if (now != o.smem_bits[i])
      fail(fmt("the shared memory a wgmma (op %llu of warpgroup %d, %s) reads as its %s operand changed while the op "
               "was in flight: offset 0x%x held 0x%04x at the mma_async and 0x%04x at the wgmma_wait that retires it. "
               "A bulk copy landed there, or a thread wrote it, before the op was retired (or the operand's copy had "
               "not landed when the op was issued: a wait on its mbarrier missing). The tensor core reads its shared "
               "operands at some time between the two (PTX ISA: they must not be modified before the wait_group)",
               o.seq, g, wg_threads(g).c_str(), i < o.a_elems ? "A" : "B", o.smem_at[i], o.smem_bits[i], now));
  }
  const WgmmaComputeFn fn = g_hop.compute_override ? g_hop.compute_override : &wgmma_compute;
  const std::string err = fn(o.op, o.op.a_in_regs ? o.a : nullptr, o.d, g_run->dyn_smem, g_run->dyn_size);
  if (!err.empty()) fail(fmt("warpgroup %d (%s), wgmma op %llu: %s", g, wg_threads(g).c_str(), o.seq, err.c_str()));
  // the next pending op on each accumulator starts from these values
  for (int t = 0; t < 128; ++t)
    for (size_t k = 1; k < W.ops.size(); ++k)
      if (W.ops[k].d[t] == o.d[t]) {
        if (!W.ops[k].has_snap[t]) wg_snap(W.ops[k], t);
        break;
      }
  W.ops.pop_front();
}

inline void wg_execute(int g, WgState& W, int kind) {
  switch (kind) {
    case WG_FENCE: W.fenced = true; return;
    case WG_MMA: wg_issue_op(g, W); return;
    case WG_COMMIT:
      ++W.committed;
      for (WgOp& o : W.ops)
        if (o.group < 0) o.group = W.committed;
      return;
    default: {  // WG_WAIT
      const int n = g_hop.th[128 * g].wg_arg;
      for (int i = 0; i < 128; ++i)
        if (g_hop.th[128 * g + i].wg_arg != n)
          fail(fmt("warpgroup %d: %s executed wgmma_wait<%d> while %s executed wgmma_wait<%d>", g,
                   thread_name(128 * g).c_str(), n, thread_name(128 * g + i).c_str(), g_hop.th[128 * g + i].wg_arg));
      BURSTCU_EMU_CHECK(n >= 0, "warpgroup %d: wgmma_wait<%d>: N must be >= 0", g, n);
      const long upto = W.committed - n;
      while (!W.ops.empty() && W.ops.front().group >= 0 && W.ops.front().group <= upto) wg_execute_front(g, W);
      W.fenced = false;
      return;
    }
  }
}

inline void wg_rendezvous(int kind) {
  Thread* self = g_cur;
  Run& r = *g_run;
  const int g = self->linear / 128;
  if (size_t(g) >= g_hop.wg.size())
    fail(fmt("%s reached %s, but its warpgroup %d (%s) is incomplete: the block has %d threads, and wgmma is a "
             "warpgroup instruction (128 threads)",
             where(self).c_str(), wg_kind_name(kind), g, wg_threads(g).c_str(), r.nthreads));
  for (int w = 4 * g; w < 4 * g + 4; ++w)
    if (r.warps[w].exited)
      fail(fmt("%s reached %s, but lanes 0x%08x of warp %d of its warpgroup have exited: wgmma instructions are "
               ".aligned over all 128 threads of the warpgroup",
               where(self).c_str(), wg_kind_name(kind), r.warps[w].exited, w));
  WgState& W = g_hop.wg[g];
  if (W.kind == WG_NONE) {
    W.kind = kind;
  } else if (W.kind != kind) {
    fail(fmt("divergent warpgroup %d: %s reached %s while %d thread(s) of its warpgroup wait at %s (wgmma "
             "instructions are .sync.aligned: all 128 threads execute the same one)",
             g, where(self).c_str(), wg_kind_name(kind), W.arrived, wg_kind_name(W.kind)));
  }
  const int i = self->linear % 128;
  W.arrived_mask[i / 32] |= 1u << (i % 32);
  self->state = S_WG;
  if (++W.arrived < 128) {
    yield_to_next();
    return;
  }
  wg_execute(g, W, kind);
  W.kind = WG_NONE;
  W.arrived = 0;
  for (u32& m : W.arrived_mask) m = 0;
  Thread* batch[128];
  for (int t = 0; t < 128; ++t) batch[t] = g_pool[128 * g + t];
  if (r.flags & EMU_RANDOMIZE) {
    enqueue_all(batch, 128);  // this thread too
    yield_to_next();
  } else {
    for (Thread* t : batch)
      if (t != self) enqueue(t);
    self->state = S_RUNNING;
  }
}

inline void wgmma_fence() { wg_rendezvous(WG_FENCE); }
inline void wgmma_commit() { wg_rendezvous(WG_COMMIT); }
inline void wgmma_wait(int n) {
  hth(g_cur).wg_arg = n;
  wg_rendezvous(WG_WAIT);
}

inline void wgmma_issue(float* d, int n, Elem e, const u32* a, u64 desc_a, u64 desc_b, int trans_a, int trans_b,
                        bool accumulate) {
  HThread& h = hth(g_cur);
  h.d = d;
  h.a_src = a;
  if (a) memcpy(h.a, a, sizeof h.a);
  h.op = WgmmaOp{};
  h.op.n = n;
  h.op.elem = e;
  h.op.a_in_regs = a != nullptr;
  h.op.desc_a = a ? 0 : desc_a;
  h.op.desc_b = desc_b;
  h.op.trans_a = trans_a;
  h.op.trans_b = trans_b;
  h.op.scale_d = accumulate;
  wg_rendezvous(WG_MMA);
}

// ---------------------------------------------------------------------------------------------
// Scheduler hooks (g_hopper, emu_runtime.h; installed when the library loads: emu_entry.h)

inline void hopper_block_begin() {
  const Run& r = *g_run;
  g_hop.bars.clear();
  g_hop.copies.clear();
  g_hop.copy_seq = 0;
  for (NamedBar& b : g_hop.nb) b = NamedBar{};
  g_hop.wg.assign(size_t(r.nthreads / 128), WgState{});
  g_hop.th.assign(size_t(r.nthreads), HThread{});
  g_hop.maxnreg.assign(r.warps.size(), std::vector<int>{});
  g_hop.async_view.assign(r.dyn_smem, r.dyn_smem + (r.dyn_smem ? r.dyn_size : 0));
  g_hop.fences_unseen = 0;
  g_hop.epoch = 0;
  g_hop.n_spin_queued = g_hop.n_spin_looked = 0;
}

inline void hopper_thread_exit(Thread* self) {
  if (size_t(self->linear) < g_hop.th.size()) {
    size_t unread = 0;
    for (const PendingReduce& p : hth(self).bulk) unread += !p.read;
    if (unread)
      fail(fmt("%s exited with %zu bulk tensor reduction(s) not waited for (bulk_wait_group / _read): their shared "
               "source may be gone before they read it", where(self).c_str(), unread));
    for (const PendingReduce& p : hth(self).bulk) reduce_bytes(p);  // read: their writes complete anyway
    hth(self).bulk.clear();
  }
  const int g = self->linear / 128;
  if (size_t(g) >= g_hop.wg.size()) return;
  const WgState& W = g_hop.wg[g];
  if (W.kind != WG_NONE)
    fail(fmt("%s exited while %d thread(s) of its warpgroup wait for it at %s", where(self).c_str(), W.arrived,
             wg_kind_name(W.kind)));
  if (!W.ops.empty()) {
    int uncommitted = 0;
    for (const WgOp& o : W.ops) uncommitted += o.group < 0;
    fail(fmt("%s exited with %zu wgmma op(s) of its warpgroup not retired by a wgmma_wait (%d of them not even "
             "committed): their accumulators would never be written",
             where(self).c_str(), W.ops.size(), uncommitted));
  }
}

// A __syncthreads completed: every live thread took part.
inline void hopper_barrier_release() {
  if (g_hop.fences_unseen) refresh_async_view();
}

inline void hopper_random_point() {
  if (g_hop.copies.empty() || next_random() % 4 != 0) return;
  land(size_t(next_random() % g_hop.copies.size()));
}

inline std::string hopper_block_end() {
  if (!g_hop.copies.empty()) {
    const PendingCopy& c = g_hop.copies.front();
    return fmt("block (%u,%u,%u) ended with %zu TMA copies in flight (the first: %u bytes to shared offset 0x%x, "
               "signalling the mbarrier at 0x%x, issued by thread %d): every copy must be waited for (mbar_wait on "
               "its barrier) before the block ends",
               g_block_idx.x, g_block_idx.y, g_block_idx.z, g_hop.copies.size(), c.bytes, c.dst, c.bar, c.issuer);
  }
  for (size_t g = 0; g < g_hop.wg.size(); ++g)
    for (size_t w = 4 * g + 1; w < 4 * g + 4; ++w)
      if (g_hop.maxnreg[w] != g_hop.maxnreg[4 * g])
        return fmt("block (%u,%u,%u): warps %zu and %zu of warpgroup %zu executed %zu and %zu setmaxnreg "
                   "instruction(s) (different sequences): all warps of a warpgroup must execute the same setmaxnreg "
                   "(PTX ISA)",
                   g_block_idx.x, g_block_idx.y, g_block_idx.z, 4 * g, w, g, g_hop.maxnreg[4 * g].size(),
                   g_hop.maxnreg[w].size());
  return "";
}

inline std::string hopper_describe() {
  const Run& r = *g_run;
  std::string s;
  std::map<std::pair<u32, u32>, std::vector<int>> spin;
  std::map<int, std::vector<int>> nbar;
  for (int i = 0; i < r.nthreads && size_t(i) < g_hop.th.size(); ++i) {
    const Thread* t = g_pool[i];
    const HThread& h = g_hop.th[i];
    if (t->state == S_SPIN) spin[{h.spin_bar, h.spin_parity}].push_back(i);
    if (t->state == S_NBAR) nbar[h.nbar].push_back(i);
  }
  int shown = 0;
  for (const auto& kv : spin) {
    if (++shown > 6) {
      s += fmt(" (%zu more spinning groups)", spin.size() - 6);
      break;
    }
    const auto it = g_hop.bars.find(kv.first.first);
    s += fmt(" Threads %s spin on the mbarrier at shared offset 0x%x waiting for the phase of parity %u: ",
             ranges(kv.second).c_str(), kv.first.first, kv.first.second);
    s += it == g_hop.bars.end() ? std::string("it is not initialised.")
                                : fmt("it is in phase %llu (parity %llu), %u of %u arrivals pending, tx-count %lld.",
                                      it->second.phase, it->second.phase & 1, it->second.pending, it->second.count,
                                      it->second.tx);
  }
  for (int id = 0; id < 16; ++id) {
    const NamedBar& b = g_hop.nb[id];
    const auto it = nbar.find(id);
    if (b.arrived == 0 && it == nbar.end()) continue;
    std::vector<int> warps;
    for (int w = 0; w < 32; ++w)
      if (b.warps >> w & 1u) warps.push_back(w);
    s += fmt(" Named barrier %d: %d of %d threads arrived (warps %s)", id, b.arrived, b.expected,
             warps.empty() ? "none" : ranges(warps).c_str());
    s += it == nbar.end() ? std::string(".") : fmt("; threads %s wait in bar.sync.", ranges(it->second).c_str());
  }
  for (size_t g = 0; g < g_hop.wg.size(); ++g) {
    const WgState& W = g_hop.wg[g];
    if (W.kind == WG_NONE) continue;
    std::vector<int> missing;
    for (int i = 0; i < 128; ++i)
      if (!(W.arrived_mask[i / 32] >> (i % 32) & 1u)) missing.push_back(128 * int(g) + i);
    s += fmt(" Warpgroup %zu: %d of 128 threads wait at %s for threads %s.", g, W.arrived, wg_kind_name(W.kind),
             ranges(missing).c_str());
  }
  if (!g_hop.copies.empty()) {
    const PendingCopy& c = g_hop.copies.front();
    s += fmt(" %zu TMA copies are in flight (the first: %u bytes to shared offset 0x%x, signalling the mbarrier at "
             "0x%x).",
             g_hop.copies.size(), c.bytes, c.dst, c.bar);
  }
  if (!spin.empty()) s += " (Thread numbers are linear indices in the block.)";
  return s;
}

}  // namespace emu

#pragma GCC visibility pop
