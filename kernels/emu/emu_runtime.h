// emu_runtime.h — the CPU emulator's scheduler: blocks, barriers, warp rendezvous, cp.async, launch.
//
// How a launch runs (emu_launch at the bottom):
//   * Blocks of the grid run one after another on the calling OS thread (x fastest; shuffled when
//     randomising). That is what lets `__shared__` be a plain `static`: the threads of the running
//     block share it, and no other block runs at the same time. Launches are serialised by a mutex.
//   * Each thread of the block is a fiber (emu_fiber.h). A fiber runs until it blocks — at
//     __syncthreads, at a warp collective that not all its lanes have reached, or at exit — and then
//     switches directly to the next fiber in the run queue. Control returns to the scheduler only
//     when the queue is empty: either every thread has exited (block done) or all live threads are
//     blocked (deadlock: reported with where each thread waits).
//   * Warp collectives (shuffles, votes, __syncwarp, ldmatrix, mma) are rendezvous: each lane
//     deposits its inputs in its own slots and blocks; the last lane of the mask to arrive computes
//     every lane's outputs and wakes them. Arrivals with the same collective and mask meet; disjoint
//     lane groups may wait at different collectives at once (lanes 0-15 at a half-warp shuffle while
//     16-31 wait at __syncwarp). mma/ldmatrix (.aligned) need the whole warp at the same one.
//   * __syncthreads: all live threads must arrive at the same call site (file:line). By default a
//     thread that exits while others wait at a barrier, or a barrier reached after some thread of
//     the block exited, is an error (CUDA leaves that undefined); the flag EMU_ALLOW_EXIT makes
//     exited threads simply leave the barrier count, as sm_70+ hardware does.
//   * Randomised order (flag EMU_RANDOMIZE, seeded): threads released together (start, barrier,
//     collective) are queued in a random order, and blocks run in a random order. A kernel that
//     reads shared memory another thread writes without a barrier then gives seed-dependent results.
//   * cp.async is deferred: cp_async_16 snapshots the 16 source bytes (or zeros) at issue and writes
//     the destination only when a cp_async_wait retires its group (or the thread exits), so a read
//     of the destination before the wait sees stale data, as it may on the GPU.
//   * sm_90 (emu_hopper.h): a thread waiting on an mbarrier spins (state S_SPIN: it goes to the back
//     of the run queue between tries), a thread at bar.sync waits in S_NBAR, and the wgmma
//     instructions are rendezvous of the 128 threads of a warpgroup (S_WG). emu_hopper.h gets the
//     hooks declared below: per-block reset, exit checks, deadlock description, a random
//     scheduling point in yield_to_next (lands bulk copies early when randomising), and the
//     warp collectives elect.sync / bar.sync-arrive / setmaxnreg.
//   * Faults (stack overflow, dynamic shared-memory overflow, bad pointers, integer division by zero)
//     raise a signal that the launch catches (sigaltstack + siglongjmp) and reports as an error
//     naming the thread; all other errors are detected in code. Nothing here exits the process.
//     A watchdog timer (BURSTCU_EMU_TIMEOUT_S, default 300 s) ends a launch that never finishes,
//     e.g. a thread spinning on a flag that only a not-yet-run thread would set (emu_launch.h).
// Dynamic shared memory is poisoned with 0xFF bytes (NaN in fp32/fp16/bf16) before each block, so
// reading uninitialised dynamic smem shows. Its start is 1024-byte aligned (the sm_90 swizzle
// patterns are functions of address bits), and it ends at most 1023 bytes before a guard page:
// the size is rounded up to a multiple of 1024, and that slack is poisoned too (emu_launch.h).
#pragma once

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu_fiber.h"

// CUDA's index types live here (global namespace, as in CUDA) because the runtime stores them.
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

#pragma GCC visibility push(hidden)

namespace emu {

typedef unsigned int u32;
typedef unsigned long long u64;

enum : int { EMU_RANDOMIZE = 1, EMU_ALLOW_EXIT = 2 };
enum class Elem { f16, bf16 };

// Collective kinds; ldmatrix/mma variants get distinct codes so that mismatches are caught.
enum Kind : int {
  K_NONE = 0, K_SYNCWARP, K_SHFL_IDX, K_SHFL_UP, K_SHFL_DOWN, K_SHFL_XOR, K_BALLOT, K_ANY, K_ALL,
  K_MMA_F16, K_MMA_BF16, K_LDMATRIX /* + 2*(num-1) + trans: 6 codes */,
  K_ELECT = K_LDMATRIX + 6,  // elect.sync (emu_hopper.h)
  K_NAMED_BAR,               // the warp's part of bar.sync / bar.arrive (emu_hopper.h)
  K_SETMAXNREG               // setmaxnreg.sync.aligned (emu_hopper.h)
};

inline int ldmatrix_kind(int num, bool trans) { return K_LDMATRIX + 2 * (num == 1 ? 0 : num == 2 ? 1 : 2) + trans; }

inline const char* kind_name(int k) {
  static const char* names[] = {"none", "__syncwarp", "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "__ballot_sync", "__any_sync", "__all_sync",
                                "mma_m16n8k16<__half>", "mma_m16n8k16<__nv_bfloat16>",
                                "ldmatrix_x1", "ldmatrix_x1_trans", "ldmatrix_x2", "ldmatrix_x2_trans",
                                "ldmatrix_x4", "ldmatrix_x4_trans", "elect.sync", "bar.sync/bar.arrive",
                                "setmaxnreg"};
  return (k >= 0 && k < int(sizeof names / sizeof *names)) ? names[k] : "?";
}

// .aligned: the whole warp must be at the same instruction (elect.sync is only .sync).
inline bool is_aligned(int kind) { return kind >= K_MMA_F16 && kind != K_ELECT; }

// S_SPIN: queued between two tries of an mbarrier wait; S_NBAR: waiting for a named barrier
// (bar.sync); S_WG: waiting for the rest of its warpgroup at a wgmma instruction (emu_hopper.h).
enum State : int { S_READY, S_RUNNING, S_BARRIER, S_WARP, S_EXITED, S_SPIN, S_NBAR, S_WG };

struct CpAsync {  // one pending cp.async: destination, bytes to write, group (-1: not committed yet)
  void* dst;
  unsigned char bytes[16];
  long group;
};

struct Thread {
  Context ctx;
  Stack stack;
  uint3 tid;
  int linear = 0, lane = 0, warp = 0;
  int state = S_READY;
  bool queued = false;
  // warp collective slots: inputs written by the lane, outputs written by the last arriver
  u32 in[10];
  u64 val = 0;
  long arg = 0;
  int width = 32;
  const void* ptr = nullptr;
  u32 out[4];
  u64 outv = 0;
  // cp.async
  std::vector<CpAsync> cp;
  long cp_committed = 0;
};

// Lanes waiting at one collective. Disjoint groups of a warp may wait at different collectives at
// the same time (e.g. lanes 0-15 at a half-warp shuffle while 16-31 wait at __syncwarp).
struct Group {
  int kind = K_NONE;
  u32 mask = 0, arrived = 0;
};

struct Warp {
  u32 exist = 0, exited = 0;  // lanes that exist in this block / have exited
  int ngroups = 0;
  Group groups[32];
  Group* find(u32 lanes) {  // a pending group whose mask meets `lanes`
    for (int i = 0; i < ngroups; ++i)
      if (groups[i].mask & lanes) return &groups[i];
    return nullptr;
  }
  Group* find(int kind, u32 mask) {  // the pending group this arrival joins
    for (int i = 0; i < ngroups; ++i)
      if (groups[i].kind == kind && groups[i].mask == mask) return &groups[i];
    return nullptr;
  }
  void remove(Group* g) { *g = groups[--ngroups]; }
};

struct Run {  // the state of one launch
  std::function<void()> body;
  unsigned dim[3] = {1, 1, 1};
  int nthreads = 0, live = 0, exited = 0;
  std::vector<Warp> warps;
  // barrier
  int bar_waiting = 0;
  const char* bar_file = nullptr;
  int bar_line = 0;
  // run queue (ring buffer; a thread is queued at most once)
  std::vector<Thread*> queue;
  size_t q_head = 0, q_count = 0;
  int flags = 0;
  u64 rng = 0;
  bool failed = false;
  std::string error;
  unsigned char* dyn_smem = nullptr;
  size_t dyn_size = 0;
};

// Hooks into the sm_90 machinery (emu_hopper.h, which emu_launch.h includes): emu_entry.h fills them
// in when the library loads, so every library that launches kernels holds emu_entry.h (it also holds
// the entry points the launches go through). A library without it (e.g. a shim around one header's
// math) must not reach them: the unset ones do nothing, but `collective` is called as it is.
struct HopperHooks {
  void (*block_begin)() = nullptr;                 // per-block reset
  std::string (*block_end)() = nullptr;            // checks once every thread has exited ("" = fine)
  void (*thread_exit)(Thread* self) = nullptr;     // checks when a thread exits (may fail())
  void (*random_point)() = nullptr;                // a scheduling point when randomising
  void (*barrier_release)() = nullptr;             // a __syncthreads completed
  std::string (*describe)() = nullptr;             // the sm_90 part of a deadlock report
  void (*collective)(int warp, const Group& g) = nullptr;  // K_ELECT, K_NAMED_BAR, K_SETMAXNREG
};
inline HopperHooks g_hopper;

inline Run* g_run = nullptr;
inline Thread* g_cur = nullptr;  // the running fiber; nullptr while the scheduler runs
inline Context g_sched;
inline std::vector<Thread*> g_pool;  // fibers, reused across blocks and launches
inline uint3 g_block_idx = {0, 0, 0};
inline dim3 g_block_dim;
inline dim3 g_grid_dim;

// ---------------------------------------------------------------------------------------------
// Errors

inline std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

inline std::string where(const Thread* t) {
  return fmt("thread (%u,%u,%u) of block (%u,%u,%u)", t->tid.x, t->tid.y, t->tid.z, g_block_idx.x, g_block_idx.y,
             g_block_idx.z);
}

// Record an error. Inside a fiber, abandon it (and the launch) by switching to the scheduler.
[[noreturn]] inline void fail(const std::string& msg) {
  if (!g_run->failed) {
    g_run->failed = true;
    g_run->error = msg;
  }
  Thread* self = g_cur;
  g_cur = nullptr;
  context_switch(&self->ctx, &g_sched);
  abort();  // unreachable: a failed fiber is never resumed
}

// The message is formatted only when the check fails: these checks sit on the hot path.
#define BURSTCU_EMU_CHECK(cond, ...)                                        \
  do {                                                                      \
    if (__builtin_expect(!(cond), 0)) ::emu::fail(::emu::fmt(__VA_ARGS__)); \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Stopping a launch: a fault's signal or the watchdog's (emu_launch.h) jumps back into run_grid.
// The watchdog's first signal only raises g_watchdog_fired; the scheduler jumps at its next
// switch point (watchdog_point), outside the C library, so no lock of it is left held.

inline sigjmp_buf g_fault_jmp;
constexpr int kWatchdogSignal = SIGVTALRM;  // unused by CPython and pytest-timeout (which use SIGALRM)
inline volatile sig_atomic_t g_fault_signal = 0;
inline void* volatile g_fault_addr = nullptr;
inline volatile sig_atomic_t g_watchdog_fired = 0;

inline void watchdog_point() {
  if (__builtin_expect(g_watchdog_fired != 0, 0)) {
    g_fault_signal = kWatchdogSignal;
    g_fault_addr = nullptr;
    siglongjmp(g_fault_jmp, 1);
  }
}

// ---------------------------------------------------------------------------------------------
// Run queue and blocking

inline u64 next_random() {  // splitmix64
  u64 z = (g_run->rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline void enqueue(Thread* t) {
  Run& r = *g_run;
  t->state = S_READY;
  if (t->queued) return;
  t->queued = true;
  r.queue[(r.q_head + r.q_count++) % r.queue.size()] = t;
}

// Make a batch of threads runnable, in random order when randomising.
inline void enqueue_all(Thread** ts, int n) {
  if (g_run->flags & EMU_RANDOMIZE)
    for (int i = n - 1; i > 0; --i) std::swap(ts[i], ts[next_random() % u64(i + 1)]);
  for (int i = 0; i < n; ++i) enqueue(ts[i]);
}

inline Thread* dequeue() {
  Run& r = *g_run;
  if (r.q_count == 0) return nullptr;
  Thread* t = r.queue[r.q_head];
  r.q_head = (r.q_head + 1) % r.queue.size();
  --r.q_count;
  t->queued = false;
  return t;
}

// The running fiber stops (its state already says why, or it is queued) and the next one runs.
inline void yield_to_next() {
  watchdog_point();
  if ((g_run->flags & EMU_RANDOMIZE) && g_hopper.random_point) g_hopper.random_point();
  Thread* self = g_cur;
  Thread* next = dequeue();
  if (next == self) {
    self->state = S_RUNNING;
    return;
  }
  if (next) {
    next->state = S_RUNNING;
    g_cur = next;
    context_switch(&self->ctx, &next->ctx);
  } else {
    g_cur = nullptr;
    context_switch(&self->ctx, &g_sched);
  }
  // resumed: whoever switched here set g_cur = self
  if (g_run->failed) fail(g_run->error);
}

// ---------------------------------------------------------------------------------------------
// Barrier

inline const char* short_file(const char* f) {
  const char* s = strrchr(f, '/');
  return s ? s + 1 : f;
}

inline void release_barrier() {
  Run& r = *g_run;
  std::vector<Thread*> batch;
  batch.reserve(r.nthreads);
  for (int i = 0; i < r.nthreads; ++i)
    if (g_pool[i]->state == S_BARRIER) batch.push_back(g_pool[i]);
  r.bar_waiting = 0;
  r.bar_file = nullptr;
  if (g_hopper.barrier_release) g_hopper.barrier_release();
  enqueue_all(batch.data(), int(batch.size()));
}

inline void syncthreads(const char* file, int line) {
  Run& r = *g_run;
  Thread* self = g_cur;
  if (r.exited > 0 && !(r.flags & EMU_ALLOW_EXIT))
    fail(fmt("__syncthreads at %s:%d reached by %s after %d thread(s) of the block exited: a barrier that "
             "not all threads reach is undefined in CUDA",
             short_file(file), line, where(self).c_str(), r.exited));
  if (const Group* g = r.warps[self->warp].find(1u << self->lane))
    fail(fmt("%s reached __syncthreads at %s:%d while lanes 0x%08x of its warp wait for it at %s", where(self).c_str(),
             short_file(file), line, g->arrived, kind_name(g->kind)));
  if (r.bar_waiting == 0) {
    r.bar_file = file;
    r.bar_line = line;
  } else if (r.bar_line != line || strcmp(r.bar_file, file) != 0) {
    fail(fmt("divergent __syncthreads: %s is at %s:%d while %d thread(s) wait at %s:%d", where(self).c_str(),
             short_file(file), line, r.bar_waiting, short_file(r.bar_file), r.bar_line));
  }
  ++r.bar_waiting;
  self->state = S_BARRIER;
  if (r.bar_waiting == r.live) {
    release_barrier();  // queues every waiter, this thread included
  }
  yield_to_next();
}

// ---------------------------------------------------------------------------------------------
// Warp collectives

inline Thread* lane_thread(int warp, int lane) { return g_pool[warp * 32 + lane]; }

inline void compute_collective(int warp, const Group& g);  // defined in emu_collectives.h

// All lanes of group g have arrived: compute, remove the group, and list its lanes in batch.
inline int finish_group(int warp, Group* g, Thread** batch) {
  const u32 mask = g->mask;
  compute_collective(warp, *g);
  g_run->warps[warp].remove(g);
  int n = 0;
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1u) batch[n++] = lane_thread(warp, l);
  return n;
}

// Rendezvous of the lanes in `mask` at collective `kind`; inputs are already in g_cur's slots.
inline void collective(int kind, u32 mask) {
  Run& r = *g_run;
  Thread* self = g_cur;
  Warp& w = r.warps[self->warp];
  const u32 bit = 1u << self->lane;
  if (!(mask & bit))
    fail(fmt("%s called %s with mask 0x%08x that does not include its own lane %d", where(self).c_str(),
             kind_name(kind), mask, self->lane));
  if (mask & ~w.exist)
    fail(fmt("%s: %s mask 0x%08x names lanes that do not exist (the block has %d threads; warp %d has lanes 0x%08x)",
             where(self).c_str(), kind_name(kind), mask, r.nthreads, self->warp, w.exist));
  if (mask & w.exited)
    fail(fmt("%s: %s mask 0x%08x names lanes 0x%08x that have exited", where(self).c_str(), kind_name(kind), mask,
             mask & w.exited));
  Group* g = w.find(kind, mask);
  if (!g) {
    // .aligned instructions (mma, ldmatrix) need the whole warp at the same instruction; other
    // mismatches may resolve later (or end in a deadlock, which the scheduler reports).
    for (int i = 0; i < w.ngroups; ++i)
      if (is_aligned(kind) || is_aligned(w.groups[i].kind))
        fail(fmt("%s reached %s (mask 0x%08x) while lanes 0x%08x of warp %d wait at %s (mask 0x%08x): "
                 "mma/ldmatrix need every lane of the warp at the same instruction",
                 where(self).c_str(), kind_name(kind), mask, w.groups[i].arrived, self->warp,
                 kind_name(w.groups[i].kind), w.groups[i].mask));
    g = &w.groups[w.ngroups++];
    *g = Group{kind, mask, 0};
  }
  g->arrived |= bit;
  self->state = S_WARP;
  if (g->arrived != g->mask) {
    yield_to_next();
    return;
  }
  Thread* batch[32];
  const int n = finish_group(self->warp, g, batch);
  if (r.flags & EMU_RANDOMIZE) {
    enqueue_all(batch, n);  // this lane too: it need not be the first to go on
    yield_to_next();
  } else {
    for (int i = 0; i < n; ++i)
      if (batch[i] != self) enqueue(batch[i]);
    self->state = S_RUNNING;
  }
}

// ---------------------------------------------------------------------------------------------
// cp.async (per thread; see the opening comment for why the write is deferred)

inline void cp_async_16(void* dst, const void* src, bool valid) {
  Thread* self = g_cur;
  BURSTCU_EMU_CHECK((reinterpret_cast<uintptr_t>(dst) & 15) == 0,
                    "%s: cp_async_16 destination %p is not 16-byte aligned", where(self).c_str(), dst);
  CpAsync c;
  c.dst = dst;
  c.group = -1;
  if (valid) {
    BURSTCU_EMU_CHECK((reinterpret_cast<uintptr_t>(src) & 15) == 0, "%s: cp_async_16 source %p is not 16-byte aligned",
                      where(self).c_str(), src);
    memcpy(c.bytes, src, 16);
  } else {
    memset(c.bytes, 0, 16);
  }
  self->cp.push_back(c);
}

inline void cp_async_commit() {
  Thread* self = g_cur;
  ++self->cp_committed;
  for (CpAsync& c : self->cp)
    if (c.group < 0) c.group = self->cp_committed;
}

// Retire every committed group older than the newest n (n < 0: everything, committed or not).
inline void cp_async_retire(Thread* t, long n) {
  const long upto = t->cp_committed - (n < 0 ? 0 : n);
  size_t keep = 0;
  for (size_t i = 0; i < t->cp.size(); ++i) {
    CpAsync& c = t->cp[i];
    if (n < 0 || (c.group >= 0 && c.group <= upto))
      memcpy(c.dst, c.bytes, 16);
    else
      t->cp[keep++] = c;
  }
  t->cp.resize(keep);
}

inline void cp_async_wait(int n) { cp_async_retire(g_cur, n); }

// ---------------------------------------------------------------------------------------------
// Thread exit

inline void thread_exit(Thread* self) {
  Run& r = *g_run;
  cp_async_retire(self, -1);
  self->state = S_EXITED;
  --r.live;
  ++r.exited;
  Warp& w = r.warps[self->warp];
  w.exited |= 1u << self->lane;
  if (Group* g = w.find(1u << self->lane)) {
    // bar.sync / bar.arrive wait only for the warp's lanes that have not exited (PTX ISA)
    if (g->kind != K_NAMED_BAR)
      fail(fmt("%s exited while lanes 0x%08x of its warp wait for it at %s (mask 0x%08x)", where(self).c_str(),
               g->arrived, kind_name(g->kind), g->mask));
    g->mask &= ~(1u << self->lane);
    if (g->arrived == g->mask) {
      Thread* batch[32];
      const int n = finish_group(self->warp, g, batch);
      enqueue_all(batch, n);
    }
  }
  if (g_hopper.thread_exit) g_hopper.thread_exit(self);
  if (r.bar_waiting > 0) {
    if (!(r.flags & EMU_ALLOW_EXIT))
      fail(fmt("%s exited while %d thread(s) wait at __syncthreads at %s:%d", where(self).c_str(), r.bar_waiting,
               short_file(r.bar_file), r.bar_line));
    if (r.bar_waiting == r.live) release_barrier();
  }
  yield_to_next();
  abort();  // an exited fiber is never resumed
}

inline void fiber_main(Thread* self) {
  try {
    g_run->body();
  } catch (const std::exception& e) {
    fail(fmt("%s threw a C++ exception: %s", where(self).c_str(), e.what()));
  } catch (...) {
    fail(fmt("%s threw a C++ exception", where(self).c_str()));
  }
  thread_exit(self);
}

inline void trap() { fail(fmt("%s called __trap()", where(g_cur).c_str())); }

inline unsigned char* dynamic_smem() { return g_run->dyn_smem; }

}  // namespace emu

#pragma GCC visibility pop
