// emu_launch.h — kernel registry, the per-block scheduler loop, fault handling and `launch`, which
// the C entry points that burstcu/build/emulate.py calls through ctypes (emu_entry.h) run:
//
//   BURSTCU_EMU_REGISTER("name<args>", (name<args>));   // at namespace scope, after the kernel
//   int emu_launch(name, gx, gy, gz, bx, by, bz, dynamic_smem, args, arg_sizes, arg_kinds, nargs,
//                  seed, flags, err, errlen)
//   void emu_release()   // unmaps the fibers and shared memory the module keeps across launches
// `args` is like cuLaunchKernel's kernelParams: args[i] points at the value of parameter i (any
// alignment: each is copied out with memcpy). `arg_sizes[i]` and `arg_kinds[i]` ('p' pointer,
// 'i' signed integer, 'u' unsigned integer, 'f' floating point, 'b' bool, 's' a struct passed by
// value, e.g. the kernels' parameter structs as numpy.void) are checked against the C++
// signature before anything runs, so a np.int64 passed for an `int`, or a struct of another size,
// is an error message, not a garbage value. Returns 0 on success, otherwise non-zero with a
// message in err. Names are compared with whitespace removed.
#pragma once

#include <sys/syscall.h>
#include <time.h>

#include "emu_collectives.h"

#pragma GCC visibility push(hidden)

namespace emu {

// ---------------------------------------------------------------------------------------------
// Registry

struct Kernel {
  std::string name;
  std::vector<size_t> sizes;
  std::string kinds;
  std::function<std::function<void()>(void**)> bind;  // args -> body that every thread runs
};

inline std::vector<Kernel>& registry() {
  static std::vector<Kernel> r;
  return r;
}

inline std::string strip_spaces(const char* s) {
  std::string out;
  for (; *s; ++s)
    if (*s != ' ' && *s != '\t' && *s != '\n') out += *s;
  return out;
}

template <typename T> constexpr char kind_of() {
  using U = std::decay_t<T>;
  if constexpr (std::is_pointer_v<U>) return 'p';
  else if constexpr (std::is_same_v<U, bool>) return 'b';
  else if constexpr (std::is_floating_point_v<U>) return 'f';
  else if constexpr (std::is_enum_v<U>) return std::is_signed_v<std::underlying_type_t<U>> ? 'i' : 'u';
  else if constexpr (std::is_integral_v<U>) return std::is_signed_v<U> ? 'i' : 'u';
  else return 's';  // a struct passed by value: its size is checked, not its fields
}

// The value of a parameter of type T from the bytes at p (a host buffer of any alignment).
template <typename T> T load_arg(const void* p) {
  static_assert(std::is_trivially_copyable_v<T>, "kernel parameters are copied bytewise");
  T value;
  memcpy(static_cast<void*>(&value), p, sizeof(T));
  return value;
}

template <typename... P, size_t... I>
std::function<void()> bind_args(void (*fn)(P...), void** args, std::index_sequence<I...>) {
  // Copy every argument once per launch; each thread then calls fn with its own copies.
  auto values = std::make_shared<std::tuple<std::decay_t<P>...>>(load_arg<std::decay_t<P>>(args[I])...);
  return [fn, values] { std::apply(fn, *values); };
}

struct Registrar {
  template <typename... P> Registrar(const char* name, void (*fn)(P...)) {
    Kernel k;
    k.name = strip_spaces(name);
    k.sizes = {sizeof(std::decay_t<P>)...};
    k.kinds = std::string{kind_of<P>()...};
    k.bind = [fn](void** args) { return bind_args(fn, args, std::index_sequence_for<P...>{}); };
    registry().push_back(std::move(k));
  }
};

// ---------------------------------------------------------------------------------------------
// Fibers and dynamic shared memory, kept across launches

inline size_t stack_bytes() {
  const char* kb = getenv("BURSTCU_EMU_STACK_KB");
  const long v = kb ? atol(kb) : 0;
  return size_t(v > 0 ? v : 64) * 1024;
}

inline bool ensure_pool(int n, std::string* err) {
  while (int(g_pool.size()) < n) {
    Thread* t = new Thread();
    if (!stack_map(&t->stack, stack_bytes(), 64 * 1024)) {
      delete t;
      *err = "cannot map fiber stacks (mmap failed)";
      return false;
    }
    g_pool.push_back(t);
  }
  return true;
}

struct DynSmem;
inline void release_dyn_smem();

// Unmaps the fibers and the dynamic shared memory kept across launches. Each fiber holds two
// memory mappings (its stack and the guard below it) and every loaded module keeps its own pool,
// so a process that loads many modules (a test suite: one a kernel variant) would reach the
// kernel's limit on mappings (vm.max_map_count, 65530 by default) and see mmap fail, in the
// emulator or anywhere else in the process. burstcu/build/emulate.py releases a module's pool
// when a launch goes to another module.
inline void release_pool() {
  for (Thread* t : g_pool) {
    stack_unmap(&t->stack);
    delete t;
  }
  g_pool.clear();
  release_dyn_smem();
}

struct DynSmem {
  char* map = nullptr;
  size_t map_size = 0, capacity = 0;  // capacity: usable bytes before the guard page
};
inline DynSmem g_dyn;

inline void release_dyn_smem() {
  if (g_dyn.map) munmap(g_dyn.map, g_dyn.map_size);
  g_dyn = DynSmem{};
}

// The bytes mapped for `size` bytes of dynamic shared memory: rounded up to 1024 so that the start
// is 1024-byte aligned (the sm_90 swizzle patterns, TMA's and wgmma's, are functions of the shared
// address bits, and the kernels align their tiles to 1024 bytes relative to this start).
inline size_t dyn_smem_span(size_t size) { return (size + 1023) / 1024 * 1024; }

// A buffer of `size` bytes, 1024-byte aligned, whose end is within 1023 bytes of a PROT_NONE page:
// the slack (dyn_smem_span(size) - size bytes) is poisoned like the rest (run_block), so an
// overflow into it reads NaN and one past it faults.
inline unsigned char* dyn_smem_buffer(size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t need = dyn_smem_span(size);
  if (!g_dyn.map || need > g_dyn.capacity) {
    release_dyn_smem();
    g_dyn.capacity = (need + page - 1) / page * page;
    g_dyn.map_size = g_dyn.capacity + page;
    void* m = mmap(nullptr, g_dyn.map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      g_dyn = DynSmem{};
      return nullptr;
    }
    g_dyn.map = static_cast<char*>(m);
    mprotect(g_dyn.map + g_dyn.capacity, page, PROT_NONE);
  }
  return reinterpret_cast<unsigned char*>(g_dyn.map + g_dyn.capacity - need);
}

// ---------------------------------------------------------------------------------------------
// Faults: a signal on the launching OS thread jumps back into emu_launch; others are not ours.
// The watchdog timer's signal takes the same path when the scheduler has not stopped the launch
// within kWatchdogGraceS of its first (`watchdog_point`, emu_runtime.h).

constexpr double kWatchdogGraceS = 0.1;
inline timer_t g_watchdog_timer;
inline volatile sig_atomic_t g_watchdog_armed = 0;
inline pthread_t g_launch_thread;
inline volatile sig_atomic_t g_launching = 0;
constexpr int kNumSignals = 5;
inline struct sigaction g_old_actions[kNumSignals];
inline const int g_fault_signals[kNumSignals] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, kWatchdogSignal};

inline void set_timer(timer_t id, double seconds) {  // timer_settime: async-signal-safe
  struct itimerspec its;
  memset(&its, 0, sizeof its);
  its.it_value.tv_sec = static_cast<time_t>(seconds);
  its.it_value.tv_nsec = static_cast<long>((seconds - double(its.it_value.tv_sec)) * 1e9);
  timer_settime(id, 0, &its, nullptr);
}

inline void on_fault(int sig, siginfo_t* info, void* uctx) {
  if (g_launching && pthread_equal(pthread_self(), g_launch_thread)) {
    if (sig == kWatchdogSignal && !g_watchdog_fired && g_watchdog_armed) {
      g_watchdog_fired = 1;  // the scheduler stops the launch at its next switch point; a thread
      set_timer(g_watchdog_timer, kWatchdogGraceS);  // spinning without one, the next signal
      return;
    }
    g_fault_signal = sig;
    g_fault_addr = info->si_addr;
    siglongjmp(g_fault_jmp, 1);
  }
  for (int i = 0; i < kNumSignals; ++i) {  // someone else's fault: hand it to the previous handler
    if (g_fault_signals[i] != sig) continue;
    const struct sigaction& old = g_old_actions[i];
    if (old.sa_flags & SA_SIGINFO) {
      old.sa_sigaction(sig, info, uctx);
      return;
    }
    if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
      old.sa_handler(sig);
      return;
    }
    sigaction(sig, &old, nullptr);  // default action: returning re-executes the fault, which then kills
    return;
  }
}

struct FaultGuard {  // installs the handlers and an alternate signal stack for one launch
  stack_t old_stack;
  bool ok = false;
  FaultGuard() {
    static char* alt = static_cast<char*>(malloc(1 << 16));
    stack_t ss;
    ss.ss_sp = alt;
    ss.ss_size = 1 << 16;
    ss.ss_flags = 0;
    if (sigaltstack(&ss, &old_stack) != 0) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < kNumSignals; ++i) sigaction(g_fault_signals[i], &sa, &g_old_actions[i]);
    g_launch_thread = pthread_self();
    g_launching = 1;
    ok = true;
  }
  ~FaultGuard() {
    if (!ok) return;
    g_launching = 0;
    for (int i = 0; i < kNumSignals; ++i) sigaction(g_fault_signals[i], &g_old_actions[i], nullptr);
    sigaltstack(&old_stack, nullptr);
  }
};

// Fibers never preempt each other, so a thread that spins on a flag another thread (or a later
// block) sets never lets that thread run: the launch would hang where a GPU finishes. A timer
// signal aimed at the launching thread turns that into an error after BURSTCU_EMU_TIMEOUT_S
// seconds (default 300; 0 disables). Its first signal asks the scheduler to stop at its next
// switch point, where no C library call is under way (a jump out of one, malloc say, would leave
// its lock held and hang the process's next call); a thread that reaches none within
// kWatchdogGraceS (a spin loop in kernel code, which calls no library) is stopped by the jump.
inline double watchdog_seconds() {
  const char* v = getenv("BURSTCU_EMU_TIMEOUT_S");
  return v ? atof(v) : 300.0;
}

// Made (its timer created, nothing armed) before the jump target of its signal exists, armed by
// `arm` after (`run_grid`): a timer that fired before would jump into a stale buffer (a tiny
// BURSTCU_EMU_TIMEOUT_S hung the process that way). Every member is written before the target is
// set (values written between sigsetjmp and a jump back are indeterminate after it), and the
// destructor deletes a created timer however the launch ends, an early signal included.
struct Watchdog {
  timer_t id{};
  bool created = false;
  explicit Watchdog(double seconds) {
    if (seconds <= 0) return;
    struct sigevent sev;
    memset(&sev, 0, sizeof sev);
    sev.sigev_notify = SIGEV_THREAD_ID;
    sev.sigev_signo = kWatchdogSignal;
#if defined(sigev_notify_thread_id)
    sev.sigev_notify_thread_id = static_cast<pid_t>(syscall(SYS_gettid));
#else
    sev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
#endif
    created = timer_create(CLOCK_MONOTONIC, &sev, &id) == 0;
  }
  void arm(double seconds) const {
    g_watchdog_fired = 0;
    if (!created) return;
    g_watchdog_timer = id;
    g_watchdog_armed = 1;
    set_timer(id, seconds);
  }
  ~Watchdog() {
    if (!created) return;
    g_watchdog_armed = 0;
    timer_delete(id);
  }
};

inline std::string describe_fault(int sig, void* addr) {
  const std::string who = g_cur ? where(g_cur) : std::string("the emulator's scheduler");
  if (sig == kWatchdogSignal)
    return fmt("the launch ran longer than BURSTCU_EMU_TIMEOUT_S = %g s; stopped in %s. A thread spinning on a "
               "value that another thread or block sets never yields to it in the emulator (threads switch only at "
               "__syncthreads, warp collectives, mbarrier waits, named barriers, wgmma and exit)",
               watchdog_seconds(), who.c_str());
  if (sig == SIGSEGV || sig == SIGBUS) {
    for (Thread* t : g_pool)
      if (t->stack.in_guard(addr))
        return fmt("stack overflow in %s (fiber stacks are %zu KB; set BURSTCU_EMU_STACK_KB for more)", who.c_str(),
                   stack_bytes() / 1024);
    const char* a = static_cast<const char*>(addr);
    if (g_dyn.map && a >= g_dyn.map + g_dyn.capacity && a < g_dyn.map + g_dyn.map_size)
      return fmt("dynamic shared memory overflow in %s: address %p is past the %zu bytes the launch requested",
                 who.c_str(), addr, g_run ? g_run->dyn_size : size_t(0));
    return fmt("invalid memory access (signal %d) at address %p in %s", sig, addr, who.c_str());
  }
  if (sig == SIGFPE) return fmt("arithmetic fault (SIGFPE, e.g. integer division by zero) in %s", who.c_str());
  return fmt("illegal instruction (signal %d) in %s", sig, who.c_str());
}

// ---------------------------------------------------------------------------------------------
// One block

inline std::string describe_deadlock() {
  Run& r = *g_run;
  std::string s = fmt("deadlock in block (%u,%u,%u): %d live thread(s) are all blocked.", g_block_idx.x,
                      g_block_idx.y, g_block_idx.z, r.live);
  if (r.bar_waiting)
    s += fmt(" %d wait at __syncthreads at %s:%d.", r.bar_waiting, short_file(r.bar_file), r.bar_line);
  for (size_t w = 0; w < r.warps.size(); ++w)
    for (int i = 0; i < r.warps[w].ngroups; ++i) {
      const Group& g = r.warps[w].groups[i];
      s += fmt(" Warp %zu: lanes 0x%08x wait at %s for lanes 0x%08x (mask 0x%08x).", w, g.arrived, kind_name(g.kind),
               g.mask & ~g.arrived, g.mask);
    }
  return g_hopper.describe ? s + g_hopper.describe() : s;
}

inline void run_block() {
  Run& r = *g_run;
  std::vector<Thread*> start(r.nthreads);
  for (int i = 0; i < r.nthreads; ++i) {
    Thread* t = g_pool[i];
    t->tid = {unsigned(i) % r.dim[0], unsigned(i) / r.dim[0] % r.dim[1], unsigned(i) / (r.dim[0] * r.dim[1])};
    t->linear = i;
    t->lane = i % 32;
    t->warp = i / 32;
    t->state = S_READY;
    t->queued = false;
    t->cp.clear();
    t->cp_committed = 0;
    context_init(&t->ctx, t->stack, &fiber_main, t);
    start[i] = t;
  }
  for (size_t w = 0; w < r.warps.size(); ++w) {
    const int n = std::min(32, r.nthreads - int(w) * 32);
    r.warps[w].ngroups = 0;
    r.warps[w].exited = 0;
    r.warps[w].exist = n == 32 ? 0xffffffffu : ((1u << n) - 1);
  }
  r.live = r.nthreads;
  r.exited = 0;
  r.bar_waiting = 0;
  r.q_head = r.q_count = 0;
  if (r.dyn_smem) memset(r.dyn_smem, 0xff, dyn_smem_span(r.dyn_size));
  if (g_hopper.block_begin) g_hopper.block_begin();
  enqueue_all(start.data(), r.nthreads);
  while (!r.failed) {
    watchdog_point();
    Thread* t = dequeue();
    if (!t) break;
    t->state = S_RUNNING;
    g_cur = t;
    context_switch(&g_sched, &t->ctx);
    g_cur = nullptr;
  }
  if (!r.failed && r.live > 0) {
    r.failed = true;
    r.error = describe_deadlock();
  }
  if (!r.failed && g_hopper.block_end) {
    std::string err = g_hopper.block_end();
    if (!err.empty()) {
      r.failed = true;
      r.error = err;
    }
  }
}

inline const Kernel* find_kernel(const char* name) {
  const std::string key = strip_spaces(name);
  for (const Kernel& k : registry())
    if (k.name == key) return &k;
  return nullptr;
}

inline std::string check_args(const Kernel& k, const size_t* sizes, const char* kinds, int nargs) {
  if (nargs != int(k.sizes.size()))
    return fmt("%s takes %zu argument(s), got %d", k.name.c_str(), k.sizes.size(), nargs);
  for (int i = 0; i < nargs; ++i) {
    const char want = k.kinds[i], got = kinds ? kinds[i] : want;
    if (sizes[i] != k.sizes[i] || got != want)
      return fmt("%s: argument %d is a %zu-byte '%c' in C++ but a %zu-byte '%c' was passed "
                 "(kinds: p pointer, i signed, u unsigned, f float, b bool, s struct)",
                 k.name.c_str(), i, k.sizes[i], want, sizes[i], got);
  }
  return "";
}

inline std::string check_config(unsigned const g[3], unsigned const b[3], size_t dyn) {
  const unsigned long long threads = 1ull * b[0] * b[1] * b[2];
  if (!g[0] || !g[1] || !g[2] || !b[0] || !b[1] || !b[2]) return "grid and block dimensions must be >= 1";
  if (threads > 1024) return fmt("block of %llu threads exceeds CUDA's limit of 1024", threads);
  if (b[2] > 64) return fmt("blockDim.z = %u exceeds CUDA's limit of 64", b[2]);
  if (g[1] > 65535 || g[2] > 65535) return "gridDim.y and gridDim.z must be <= 65535";
  if (dyn > 232448) return fmt("%zu bytes of dynamic shared memory exceed the sm_90 limit of 232448", dyn);
  return "";
}

// Blocks in x-fastest order, or shuffled when randomising.
inline std::vector<unsigned long long> block_order(unsigned const g[3], bool shuffle) {
  const unsigned long long n = 1ull * g[0] * g[1] * g[2];
  std::vector<unsigned long long> order(n);
  for (unsigned long long i = 0; i < n; ++i) order[i] = i;
  if (shuffle)
    for (unsigned long long i = n; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
  return order;
}

// The kernel `name`, if it exists and the arguments and launch configuration fit it; else *err says why.
inline const Kernel* checked_kernel(const char* name, unsigned const g[3], unsigned const b[3], size_t dyn,
                                    const size_t* sizes, const char* kinds, int nargs, std::string* err) {
  const Kernel* k = find_kernel(name);
  if (!k) {
    *err = fmt("no kernel registered as '%s' (registered:", name);
    for (const Kernel& kk : registry()) *err += " '" + kk.name + "'";
    *err += ")";
    return nullptr;
  }
  *err = check_args(*k, sizes, kinds, nargs);
  if (err->empty()) *err = check_config(g, b, dyn);
  return err->empty() ? k : nullptr;
}

// Run every block of the grid; a fault anywhere inside lands back here through siglongjmp.
inline void run_grid(Run& run, unsigned const g[3]) {
  const std::vector<unsigned long long> order = block_order(g, run.flags & EMU_RANDOMIZE);
  FaultGuard guard;
  const double seconds = watchdog_seconds();
  Watchdog watchdog(seconds);  // created here, armed below, deleted on every way out
  if (!guard.ok) {
    run.failed = true;
    run.error = "cannot install the emulator's signal handlers";
    return;
  }
  if (sigsetjmp(g_fault_jmp, 1) != 0) {
    run.failed = true;
    run.error = describe_fault(g_fault_signal, g_fault_addr);
    return;
  }
  watchdog.arm(seconds);
  for (unsigned long long i = 0; i < order.size() && !run.failed; ++i) {
    watchdog_point();
    const unsigned long long o = order[i];
    g_block_idx = {unsigned(o % g[0]), unsigned(o / g[0] % g[1]), unsigned(o / (1ull * g[0] * g[1]))};
    run_block();
  }
}

inline int launch(const char* name, unsigned const g[3], unsigned const b[3], size_t dyn, void** args,
                  const size_t* sizes, const char* kinds, int nargs, u64 seed, int flags, std::string* err) {
  const Kernel* k = checked_kernel(name, g, b, dyn, sizes, kinds, nargs, err);
  if (!k) return 2;
  const int nthreads = int(b[0] * b[1] * b[2]);
  if (!ensure_pool(nthreads, err)) return 3;
  Run run;
  run.body = k->bind(args);
  std::copy(b, b + 3, run.dim);
  run.nthreads = nthreads;
  run.warps.resize((nthreads + 31) / 32);
  run.queue.resize(nthreads + 1);
  run.flags = flags;
  run.rng = seed;
  run.dyn_size = dyn;
  run.dyn_smem = dyn_smem_buffer(dyn);
  if (!run.dyn_smem) {
    *err = "cannot map dynamic shared memory";
    return 3;
  }
  g_run = &run;
  g_cur = nullptr;
  g_grid_dim = {g[0], g[1], g[2]};
  g_block_dim = {b[0], b[1], b[2]};
  run_grid(run, g);
  g_cur = nullptr;
  g_run = nullptr;
  if (!run.failed) return 0;
  *err = run.error;
  return 1;
}

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace emu

#pragma GCC visibility pop

#define BURSTCU_EMU_CAT2(a, b) a##b
#define BURSTCU_EMU_CAT(a, b) BURSTCU_EMU_CAT2(a, b)
#define BURSTCU_EMU_REGISTER(NAME, FN) \
  static ::emu::Registrar BURSTCU_EMU_CAT(burstcu_emu_registrar_, __COUNTER__)(NAME, FN)

// The sm_90 machinery: the g_hopper hooks that the scheduler above calls (installed by emu_entry.h).
#include "emu_hopper.h"
