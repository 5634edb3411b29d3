// emu_entry.h — what a loaded module exposes to burstcu/build/emulate.py, and the sm_90 hooks:
// the C entry points (emu_launch, emu_kernel_names, emu_release, emu_switch_count,
// emu_global_adds; emu_launch.h's header says what each takes) and the installation of the
// g_hopper scheduler hooks (emu_runtime.h) when the library loads.
//
// Built once: burstcu/build/emulate.py compiles this header into an object of its own (a
// "runtime object", per emulator version and option set) and links that object into every
// module. A module's own translation unit includes cuda_emu.h alone, so g++ generates code
// there only for what its kernels call; the scheduler, the fault handling and the sm_90
// machinery (most of a module's build time) come from the object. Link the object itself, not an
// archive holding it: nothing refers to the hooks' installer, so a linker picking members out of an
// archive would leave it out. A build by hand needs this header in one translation unit of the
// library:
//   g++ -std=c++17 -O1 -shared -fPIC -I kernels -DBURSTCU_EMU kernel.cpp entry.cpp -o k.so -lrt
// with entry.cpp holding `#include "emu/emu_entry.h"`.
#pragma once

#include "cuda_emu.h"

#pragma GCC visibility push(hidden)

namespace emu {

// static: one installation per translation unit that includes this header (one, in a module), run
// when the library loads
static const bool g_hopper_installed = [] {
  g_hopper.block_begin = &hopper_block_begin;
  g_hopper.block_end = &hopper_block_end;
  g_hopper.thread_exit = &hopper_thread_exit;
  g_hopper.random_point = &hopper_random_point;
  g_hopper.barrier_release = &hopper_barrier_release;
  g_hopper.describe = &hopper_describe;
  g_hopper.collective = &compute_hopper_collective;
  return true;
}();

}  // namespace emu

#pragma GCC visibility pop

// ---------------------------------------------------------------------------------------------
// C entry points (default visibility: what ctypes looks up in the module; weak: harmless in
// more than one translation unit)

extern "C" __attribute__((weak, visibility("default"))) int emu_launch(
    const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
    size_t dynamic_smem, void** args, const size_t* arg_sizes, const char* arg_kinds, int nargs,
    unsigned long long seed, int flags, char* err, size_t errlen) {
  std::lock_guard<std::mutex> lock(emu::launch_mutex());
  const unsigned g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
  std::string msg;
  const int rc = emu::launch(name, g, b, dynamic_smem, args, arg_sizes, arg_kinds, nargs, seed, flags, &msg);
  if (rc && err && errlen) snprintf(err, errlen, "%s", msg.c_str());
  return rc;
}

// Registered kernel names, one per line; returns the length needed.
extern "C" __attribute__((weak, visibility("default"))) size_t emu_kernel_names(char* buf, size_t len) {
  std::string all;
  for (const emu::Kernel& k : emu::registry()) all += k.name + "\n";
  if (buf && len) snprintf(buf, len, "%s", all.c_str());
  return all.size() + 1;
}

// Gives back this module's fibers and dynamic shared memory (release_pool); the next launch maps
// them again.
extern "C" __attribute__((weak, visibility("default"))) void emu_release() {
  std::lock_guard<std::mutex> lock(emu::launch_mutex());
  emu::release_pool();
}

extern "C" __attribute__((weak, visibility("default"))) unsigned long long emu_switch_count() {
  return emu::g_switches;
}

// out[3]: atomicAdd calls, red.global.add.v2.f32 and bulk tensor reductions since load (tests).
extern "C" __attribute__((weak, visibility("default"))) void emu_global_adds(unsigned long long* out) {
  for (int i = 0; i < 3; ++i) out[i] = emu::g_global_adds[i];
}
