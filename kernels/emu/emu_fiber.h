// emu_fiber.h — cooperative fibers for the CPU emulator: one per CUDA thread of a block.
//
// A fiber is a stack plus a saved stack pointer. Switching saves the callee-saved registers of the
// running fiber on its own stack, stores its stack pointer, loads the other fiber's stack pointer
// and pops that fiber's registers: a plain function call and return, no syscall (about 10x faster
// than glibc swapcontext, which saves the signal mask with a syscall each time).
//   * x86-64 (System V): hand-written switch below (rbx, rbp, r12-r15, MXCSR, x87 control word).
//   * anything else, or -DBURSTCU_EMU_UCONTEXT: ucontext makecontext/swapcontext (slower, portable).
// Stacks are mmap'd with a PROT_NONE guard region below them, so running off the end of a stack is
// a fault at a known address, which the launcher (emu_runtime.h) turns into an error message.
// The build adds -fstack-clash-protection so a big frame probes the guard instead of jumping it.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__) || defined(BURSTCU_EMU_UCONTEXT)
#define BURSTCU_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#endif

#pragma GCC visibility push(hidden)

#if !defined(BURSTCU_EMU_USE_UCONTEXT)
// void burstcu_emu_switch(void** save_sp, void* load_sp)
// Weak, so that several translation units of one .so may each include this header.
extern "C" void burstcu_emu_switch(void** save_sp, void* load_sp);
extern "C" void burstcu_emu_trampoline();
__asm__(
    ".text\n"
    ".weak burstcu_emu_switch\n"
    ".hidden burstcu_emu_switch\n"
    ".type burstcu_emu_switch,@function\n"
    "burstcu_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size burstcu_emu_switch, .-burstcu_emu_switch\n"
    // First entry of a fiber: the switch 'returns' here with the argument in r12 and the entry
    // function in r13; rsp is 16-byte aligned, so the call gives the callee the ABI alignment.
    ".weak burstcu_emu_trampoline\n"
    ".hidden burstcu_emu_trampoline\n"
    ".type burstcu_emu_trampoline,@function\n"
    "burstcu_emu_trampoline:\n"
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n"
    ".size burstcu_emu_trampoline, .-burstcu_emu_trampoline\n");
#endif

namespace emu {

// Saved execution state of a fiber (or of the scheduler, which runs on the caller's stack).
struct Context {
#if defined(BURSTCU_EMU_USE_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

inline unsigned long long g_switches = 0;  // context switches since load (for benchmarks)
// adds into global memory since load: atomicAdd calls, red.global.add.v2.f32, bulk tensor reductions
inline unsigned long long g_global_adds[3] = {0, 0, 0};

inline void context_switch(Context* from, Context* to) {
  ++g_switches;
#if defined(BURSTCU_EMU_USE_UCONTEXT)
  swapcontext(&from->uc, &to->uc);
#else
  burstcu_emu_switch(&from->sp, to->sp);
#endif
}

// One mmap'd stack: [guard (PROT_NONE) | usable stack]; the stack grows down towards the guard.
struct Stack {
  char* base = nullptr;   // start of the mapping (the guard)
  size_t guard = 0;       // bytes of guard at base
  size_t size = 0;        // usable bytes above the guard
  bool in_guard(const void* p) const {
    const char* c = static_cast<const char*>(p);
    return base && c >= base && c < base + guard;
  }
  char* top() const { return base + guard + size; }
};

inline bool stack_map(Stack* s, size_t size, size_t guard) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size = (size + page - 1) / page * page;
  guard = (guard + page - 1) / page * page;
  void* m = mmap(nullptr, size + guard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  if (mprotect(m, guard, PROT_NONE) != 0) {
    munmap(m, size + guard);
    return false;
  }
  s->base = static_cast<char*>(m);
  s->guard = guard;
  s->size = size;
  return true;
}

// Gives a stack_map'd stack back (both of its memory mappings); a stack never mapped is a no-op.
inline void stack_unmap(Stack* s) {
  if (s->base) munmap(s->base, s->guard + s->size);
  *s = Stack{};
}

#if defined(BURSTCU_EMU_USE_UCONTEXT)
// makecontext passes int arguments only: split the pointers into halves.
template <typename Arg>
inline void ucontext_entry(unsigned fn_hi, unsigned fn_lo, unsigned arg_hi, unsigned arg_lo) {
  auto fn = reinterpret_cast<void (*)(Arg*)>((uintptr_t(fn_hi) << 32) | fn_lo);
  fn(reinterpret_cast<Arg*>((uintptr_t(arg_hi) << 32) | arg_lo));
}
#endif

// Prepare `ctx` so that switching to it calls entry(arg) on `stack`. entry must never return.
template <typename Arg>
inline void context_init(Context* ctx, const Stack& stack, void (*entry)(Arg*), Arg* arg) {
#if defined(BURSTCU_EMU_USE_UCONTEXT)
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack.base + stack.guard;
  ctx->uc.uc_stack.ss_size = stack.size;
  ctx->uc.uc_link = nullptr;
  const uintptr_t f = reinterpret_cast<uintptr_t>(entry), a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&ctx->uc, reinterpret_cast<void (*)()>(&ucontext_entry<Arg>), 4, unsigned(f >> 32), unsigned(f),
              unsigned(a >> 32), unsigned(a));
#else
  // Frame popped by burstcu_emu_switch, from low to high address:
  // [mxcsr | fpcw] r15 r14 r13=entry r12=arg rbx rbp ret=trampoline   (top is 16-byte aligned)
  uint64_t* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack.top()) & ~uintptr_t(15));
  uint64_t* sp = top - 8;
  sp[0] = 0x1F80ull | (0x037Full << 32);  // default MXCSR (all exceptions masked), default x87 control
  sp[1] = 0;                              // r15
  sp[2] = 0;                              // r14
  sp[3] = reinterpret_cast<uint64_t>(entry);  // r13
  sp[4] = reinterpret_cast<uint64_t>(arg);    // r12
  sp[5] = 0;                                  // rbx
  sp[6] = 0;                                  // rbp
  sp[7] = reinterpret_cast<uint64_t>(&burstcu_emu_trampoline);
  ctx->sp = sp;
#endif
}

}  // namespace emu

#pragma GCC visibility pop
