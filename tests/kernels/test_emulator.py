"""Tests of the CPU emulator (kernels/emu/) and of the device primitives in kernels/common.cuh.

Each test launches a small probe kernel from tests/kernels/emu_src/emu_probes.cu (ordinary CUDA
against common.cuh) and checks the result against an independent numpy computation. The fragment
layouts of mma and ldmatrix are rebuilt here from the PTX ISA tables, quoted where they are used,
so a reader can compare the two; nobody has yet checked the emulation against a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from burstcu.build.emulate import build_module
from burstcu.build.variants import kernel_dir

pytestmark = pytest.mark.emulated

PROBES = Path(__file__).parent / "emu_src" / "emu_probes.cu"
NAMES = [
    "probe_mma<__half>", "probe_mma<__nv_bfloat16>", "probe_ldmatrix", "probe_cp_async", "probe_warp",
    "probe_atomics", "probe_smem", "probe_race<true>", "probe_race<false>", "probe_convert", "probe_errors",
    "probe_struct", "bench_syncwarp", "bench_mma", "bench_ldmatrix",
]
DTYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def mod():
    return build_module([PROBES], NAMES)


def bits16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16).astype(np.uint32)


# ---------------------------------------------------------------------------------------------
# mma.m16n8k16
#
# PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type" (.f16/.bf16 A and B, .f32 C/D):
#   groupID = %laneid >> 2,  threadID_in_group = %laneid % 4
#   A (16x16, 4 .b32 registers = a0..a7, two per register, a_{2j} in the low half of register j):
#     row = groupID for a_i with 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise
#     col = threadID_in_group * 2 + (i & 0x1) for i < 4, threadID_in_group * 2 + (i & 0x1) + 8 for i >= 4
#   B (16x8, 2 registers = b0..b3):
#     row = threadID_in_group * 2 + (i & 0x1) for b_i with i < 2, ... + 8 for i >= 2;  col = groupID
#   C/D (16x8 f32, c0..c3):
#     row = groupID for c_i with i < 2, groupID + 8 for i >= 2;  col = threadID_in_group * 2 + (i & 0x1)


def a_pos(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    row = g if (0 <= i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_pos(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def c_pos(lane: int, i: int) -> tuple[int, int]:
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def fragments(A16: np.ndarray, B16: np.ndarray, C: np.ndarray):
    a_bits, b_bits = bits16(A16), bits16(B16)
    a = np.zeros((32, 4), np.uint32)
    b = np.zeros((32, 2), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        for i in range(8):
            a[lane, i // 2] |= a_bits[a_pos(lane, i)] << (16 * (i % 2))
        for i in range(4):
            b[lane, i // 2] |= b_bits[b_pos(lane, i)] << (16 * (i % 2))
        for i in range(4):
            c[lane, i] = C[c_pos(lane, i)]
    return a, b, c


def unfragment_d(d: np.ndarray) -> np.ndarray:
    D = np.full((16, 8), np.nan)
    for lane in range(32):
        for i in range(4):
            D[c_pos(lane, i)] = d[lane, i]
    return D


@pytest.mark.parametrize("ctype", ["__half", "__nv_bfloat16"])
@pytest.mark.parametrize("integers", [True, False])
def test_mma_m16n8k16(mod, ctype, integers):
    rng = np.random.default_rng(1)
    dt = DTYPES[ctype]
    if integers:  # every product and sum exact: the placement must be exactly right
        A, B, C = rng.integers(-4, 5, (16, 16)), rng.integers(-4, 5, (16, 8)), rng.integers(-8, 9, (16, 8))
    else:
        A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    A16, B16, C32 = A.astype(dt), B.astype(dt), C.astype(np.float32)
    a, b, c = fragments(A16, B16, C32)
    d = np.zeros((32, 4), np.float32)
    mod.get_function(f"probe_mma<{ctype}>")((1,), (32,), (a, b, c, d))
    want = A16.astype(np.float64) @ B16.astype(np.float64) + C32.astype(np.float64)
    got = unfragment_d(d)
    if integers:
        np.testing.assert_array_equal(got, want)
    else:  # exact products, 17 fp32 additions
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_mma_in_place_accumulate(mod):
    """d may alias c (acc = A*B + acc), as kernels use it."""
    A16 = np.eye(16, dtype=np.float16)
    B16 = np.arange(128, dtype=np.float16).reshape(16, 8)
    a, b, c = fragments(A16, B16, np.ones((16, 8), np.float32))
    d = np.zeros((32, 4), np.float32)
    mod.get_function("probe_mma<__half>")((1,), (32,), (a, b, c, d))
    np.testing.assert_array_equal(unfragment_d(d), B16.astype(np.float64)[:16] + 1)


# ---------------------------------------------------------------------------------------------
# ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16
#
# PTX ISA (ldmatrix): threads 0-7 give the row addresses of the first matrix, 8-15 of the second,
# 16-23 the third, 24-31 the fourth (x1 uses 0-7, x2 0-15). Each row is 8 b16 elements (16 bytes).
# Fragment: each thread receives, per matrix i (register i), two elements of "row groupID,
# columns threadID_in_group*2 and *2+1" with groupID = laneid >> 2, threadID_in_group = laneid % 4;
# with .trans the matrix is read column-wise: the elements of rows threadID_in_group*2, *2+1 of column groupID.


@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [0, 1])
def test_ldmatrix(mod, num, trans):
    rng = np.random.default_rng(num * 2 + trans)
    src = rng.integers(0, 65536, (32, 8)).astype(np.uint16)
    rows = rng.permutation(32).astype(np.int32)  # lane l points at shared row rows[l]
    out = np.zeros((32, 4), np.uint32)
    mod.get_function("probe_ldmatrix")((1,), (32,), (src, rows, np.int32(num), np.int32(trans), out))
    for lane in range(32):
        g, t = lane >> 2, lane % 4
        for i in range(num):
            matrix = src[rows[8 * i: 8 * i + 8]].astype(np.uint32)  # row j = address from lane 8i+j
            if trans:
                lo, hi = matrix[2 * t, g], matrix[2 * t + 1, g]
            else:
                lo, hi = matrix[g, 2 * t], matrix[g, 2 * t + 1]
            assert out[lane, i] == lo | (hi << 16), (lane, i)


# ---------------------------------------------------------------------------------------------
# cp.async


def test_cp_async_groups_and_zero_fill(mod):
    n, n_valid = 64, 40
    src = np.arange(2 * n * 4, dtype=np.float32).reshape(2, n, 4) + 1
    out = np.zeros((n, 6), np.float32)
    mod.get_function("probe_cp_async")((1,), (n,), (src, out, np.int32(n_valid)), shared_mem=2 * n * 16)
    g1 = np.where(np.arange(n) < n_valid, src[0, :, 0], 0.0)  # src-size 0 -> zeros, source unread
    np.testing.assert_array_equal(out[:, 0], -1)  # before any wait: destination still stale
    np.testing.assert_array_equal(out[:, 1], -2)
    np.testing.assert_array_equal(out[:, 2], g1)  # wait_group 1: the older group is done ...
    np.testing.assert_array_equal(out[:, 3], -2)  # ... the newest may still be in flight
    np.testing.assert_array_equal(out[:, 4], g1)
    np.testing.assert_array_equal(out[:, 5], src[1, :, 0])  # wait_group 0: everything landed


# ---------------------------------------------------------------------------------------------
# shuffles, votes, reductions


def test_shuffles_votes_reductions(mod):
    nt = 64
    x = np.random.default_rng(3).integers(-50, 50, nt).astype(np.float32)
    out = np.zeros((nt, 12), np.int32)
    mod.get_function("probe_warp")((1,), (nt,), (x, out))
    t = np.arange(nt)
    lane = t % 32
    base = t - lane
    np.testing.assert_array_equal(out[:, 0], base + (lane ^ 5))
    np.testing.assert_array_equal(out[:, 1], base + (lane & ~7) + 7)  # __shfl_sync(., 7, width 8)
    up = np.where(lane % 16 < 3, t, t - 3)  # lanes below delta in their 16-segment keep their value
    np.testing.assert_array_equal(out[:, 2], up)
    down = np.where(lane % 8 + 2 >= 8, t, t + 2)
    np.testing.assert_array_equal(out[:, 3], down)
    assert (out[:, 4].view(np.uint32) == sum(1 << l for l in range(0, 32, 3))).all()
    assert (out[:, 5] == 1).all() and (out[:, 6] == 0).all()
    xw = x.reshape(-1, 4)
    np.testing.assert_array_equal(out[:, 7], np.repeat(xw.max(1), 4).astype(np.int32))
    np.testing.assert_array_equal(out[:, 8], np.repeat(x.reshape(-1, 32).sum(1), 32).astype(np.int32))
    np.testing.assert_array_equal(out[:, 9], np.repeat(x.reshape(-1, 8).sum(1), 8).astype(np.int32))
    np.testing.assert_array_equal(out[:, 10], np.where(lane < 16, t ^ 1, -1))
    np.testing.assert_array_equal(out[:, 11], base + (lane ^ 16))  # a float's bits travel unchanged


# ---------------------------------------------------------------------------------------------
# atomics, indices, shared memory


def test_atomics_multiblock_3d(mod):
    fsum, isum = np.zeros(1, np.float32), np.zeros(1, np.int32)
    usum, imax, u64 = np.zeros(1, np.uint32), np.full(1, -1, np.int32), np.zeros(1, np.uint64)
    mod.get_function("probe_atomics")((2, 3, 1), (4, 2, 3), (fsum, isum, usum, imax, u64))
    n = 2 * 3 * 4 * 2 * 3
    assert fsum[0] == 0.5 * n and isum[0] == n * (n - 1) // 2 and usum[0] == n
    assert imax[0] == n - 1 and u64[0] == 3 * n


@pytest.mark.parametrize("randomize", [False, True])
def test_static_and_dynamic_shared_memory(mod, randomize):
    grid, block = (3, 2, 2), (8, 4, 2)
    nb, nt = 12, 64
    x = np.arange(nb * nt, dtype=np.float32)
    rev, rot = np.zeros_like(x), np.zeros_like(x)
    ids = np.zeros((nb * nt, 8), np.int32)
    mod.get_function("probe_smem")(grid, block, (x, rev, rot, ids), shared_mem=nt * 4, randomize=randomize, seed=7)
    xb = x.reshape(nb, nt)
    np.testing.assert_array_equal(rev.reshape(nb, nt), xb[:, ::-1])
    np.testing.assert_array_equal(rot.reshape(nb, nt), 2 * np.roll(xb, -1, axis=1))
    tz, ty, tx = np.unravel_index(np.arange(nt), (2, 4, 8))
    bz, by, bx = np.unravel_index(np.arange(nb), (2, 2, 3))
    ids = ids.reshape(nb, nt, 8)
    np.testing.assert_array_equal(ids[:, :, 0:3], np.broadcast_to(np.stack([tx, ty, tz], 1), (nb, nt, 3)))
    np.testing.assert_array_equal(ids[:, 0, 3:6], np.stack([bx, by, bz], 1))
    assert (ids[:, :, 6] == nt).all() and (ids[:, :, 7] == nb).all()


# ---------------------------------------------------------------------------------------------
# races and randomised order


def race(mod, barrier: bool, randomize: bool, seed: int) -> bool:
    """True when every thread read its neighbour's value."""
    nt = 128
    out = np.zeros(nt, np.int32)
    fn = mod.get_function(f"probe_race<{'true' if barrier else 'false'}>")
    fn((1,), (nt,), (out,), shared_mem=nt * 4, randomize=randomize, seed=seed)
    want = np.maximum(np.arange(nt), 1)  # s[t-1] = t, s[0] = 1
    return bool((out == want).all())


def test_missing_barrier_exposed_by_random_order(mod):
    assert race(mod, barrier=False, randomize=False, seed=0)  # the fixed order hides the race ...
    assert not all(race(mod, barrier=False, randomize=True, seed=s) for s in range(4))  # ... random does not
    assert all(race(mod, barrier=True, randomize=True, seed=s) for s in range(4))


def test_launches_without_a_seed_each_take_another_order():
    """A module built with randomize=True (as KernelOps(randomize=True) builds them) ran every
    launch in seed 0's order, so a race seed 0's order hides stayed hidden however often it ran:
    a launch that names no seed now takes the module's seed plus its launches so far, and a
    module built again repeats the same orders."""
    def reads(module) -> list[bytes]:
        fn, outs = module.get_function("probe_race<false>"), []
        for _ in range(6):
            out = np.zeros(128, np.int32)
            fn((1,), (128,), (out,), shared_mem=128 * 4)
            outs.append(out.tobytes())
        return outs
    first = reads(build_module([PROBES], NAMES, randomize=True))
    assert len(set(first)) > 1
    assert reads(build_module([PROBES], NAMES, randomize=True)) == first


# ---------------------------------------------------------------------------------------------
# errors come back as RuntimeError, never a hang or a dead interpreter

ERRORS = {
    0: "divergent __syncthreads",
    1: "exited while",
    2: "exited while lanes 0x7fffffff",
    3: "reached __syncthreads",
    4: "stack overflow",
    5: "invalid memory access",
    6: "dynamic shared memory overflow",
    7: "__trap()",
    8: "not 16-byte aligned",
    9: "deadlock in block",
}


@pytest.mark.parametrize("mode", sorted(ERRORS))
def test_errors_reported(mod, mode):
    out = np.zeros(64, np.int32)
    with pytest.raises(RuntimeError, match=ERRORS[mode].replace("(", r"\(").replace(")", r"\)")):
        mod.get_function("probe_errors")((1,), (64,), (np.int32(mode), out), shared_mem=256)
    # the emulator is still usable afterwards
    assert race(mod, barrier=True, randomize=False, seed=0)


def test_spin_wait_stopped_by_watchdog(mod, monkeypatch):
    monkeypatch.setenv("BURSTCU_EMU_TIMEOUT_S", "0.2")
    out = np.zeros(64, np.int32)
    with pytest.raises(RuntimeError, match="longer than BURSTCU_EMU_TIMEOUT_S"):
        mod.get_function("probe_errors")((1,), (64,), (np.int32(10), out))
    assert race(mod, barrier=True, randomize=False, seed=0)


def _probe_child(body: str, emu_timeout: str, limit: float) -> subprocess.CompletedProcess:
    """`body` run by a child Python under BURSTCU_EMU_TIMEOUT_S=`emu_timeout` (at most `limit`
    s), with `m` the probe module built and `probe(case)` one launch of probe_errors."""
    program = ("import os, numpy as np, sys; sys.path.insert(0, sys.argv[1]); import test_emulator as t\n"
               "m = t.build_module([t.PROBES], t.NAMES)\n"
               "def probe(case):\n"
               "    m.get_function('probe_errors')((1,), (64,), (np.int32(case), np.zeros(64, np.int32)))\n"
               + body)
    return subprocess.run([sys.executable, "-c", program, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=limit, env=dict(os.environ, BURSTCU_EMU_TIMEOUT_S=emu_timeout))

def test_a_watchdog_shorter_than_the_launch_setup_is_an_error_not_a_hang(mod):
    """BURSTCU_EMU_TIMEOUT_S = 1e-9: the timer fired before the launch had set the point its
    signal jumps back to, and the process spun in the fault handler for ever. Now it is armed
    after, each of 200 launches fails with the watchdog's message, and no timer is left behind.
    Run in a child, with a deadline, so that a hang fails this test alone."""
    proc = _probe_child("for _ in range(200):\n"
                        "    try:\n"
                        "        probe(0)\n"
                        "    except RuntimeError as e:\n"
                        "        said = str(e)\n"
                        "print(said)\n"
                        "if os.path.exists('/proc/self/timers'):\n"
                        "    left = sum(line.startswith('ID:') for line in open('/proc/self/timers'))\n"
                        "    print('timers left:', left)\n", emu_timeout="1e-9", limit=120)
    assert "the launch ran longer than BURSTCU_EMU_TIMEOUT_S = 1e-09 s" in proc.stdout, \
        proc.stdout + proc.stderr
    # every launch's timer deleted, an early signal included (one leaked a launch; enough of them
    # exhaust RLIMIT_SIGPENDING, and the watchdog then never fires)
    assert "timers left:" not in proc.stdout or "timers left: 0" in proc.stdout, proc.stdout


def test_the_watchdog_stops_a_launch_outside_the_c_library():
    """A kernel that allocates and synchronises for ever: the watchdog's signal used to jump out
    of wherever it landed, malloc included, leaving its lock held, and the process's next
    allocation waited for ever. Its first signal now asks the scheduler to stop at its next
    switch point: 40 launches stopped after 20 ms each, then the process still allocates. Run
    in a child, with a deadline, so that a hang fails this test alone."""
    proc = _probe_child("stopped = 0\n"
                        "for _ in range(40):\n"
                        "    try:\n"
                        "        probe(11)\n"
                        "    except RuntimeError as e:\n"
                        "        stopped += 'longer than BURSTCU_EMU_TIMEOUT_S' in str(e)\n"
                        "    junk = [bytearray(4096) for _ in range(1000)]\n"
                        "print('stopped', stopped)\n", emu_timeout="0.02", limit=60)
    assert "stopped 40" in proc.stdout, proc.stdout + proc.stderr


def test_exit_before_barrier_allowed_on_request(mod):
    out = np.zeros(64, np.int32)
    mod.get_function("probe_errors")((1,), (64,), (np.int32(1), out), allow_exit_before_barrier=True)


def memory_mappings() -> int:
    """The memory mappings this process holds (lines of /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_modules_run_in_turn_keep_a_few_pools_of_fibers(monkeypatch):
    """Every fiber holds two memory mappings (its stack, its guard) and each module keeps a pool:
    past emulate.POOLS_KEPT modules the least recently launched must give its pool back, or a
    process loading a few hundred modules reaches vm.max_map_count (65530) and mmap fails, in
    the emulator or anywhere else in the process. Three copies of the probe module (a -D each:
    three .so files) launch 1024 threads in turn with two pools kept: the process's mappings
    grow by at most one more pool than the first launch's, not by two."""
    from burstcu.build import emulate

    monkeypatch.setattr(emulate, "POOLS_KEPT", 2)
    threads = 1024
    modules = [build_module([PROBES], ["bench_syncwarp"], options=(f"-DBURSTCU_PROBE_COPY={i}",))
               for i in range(3)]
    assert len({id(m._lib) for m in modules}) == 3
    counts = []
    for m in modules + modules:
        out = np.zeros(threads, np.int32)
        m.get_function("bench_syncwarp")((1,), (threads,), (np.int32(3), out))
        assert (out == 3).all()
        counts.append(memory_mappings())
    pool = 2 * threads   # mappings a pool of `threads` fibers holds
    # kept: the second pool adds one, the third releases the first; all three kept: two more
    assert max(counts) - counts[0] < 1.5 * pool, counts


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_training_step_launches_from_the_pools_kept(monkeypatch, arch):
    """A forward and backward step (causal, documents, a window: the careful twins too) takes
    its kernels from at most emulate.POOLS_KEPT modules, so a training loop launches from pools
    already mapped: with fewer kept, every launch of every step unmapped one module's fibers and
    mapped another's."""
    import burstcu
    from burstcu.build import emulate
    from burstcu.group import Group
    from burstcu.ops.cuda.kernel_ops import KernelOps
    from burstcu.transport.base import SelfTransport

    launched = []
    keep = emulate._keep_pool
    monkeypatch.setattr(emulate, "_keep_pool", lambda lib: (launched.append(id(lib)), keep(lib)))
    group = Group(0, 1, "emulated", SelfTransport(), KernelOps("emulated", arch=arch))
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 256, 2, 64)).astype(np.float16) for _ in range(4))
    v[0, 200, 0, 0] = np.nan   # a key only some rows see
    mask = dict(causal=True, cu_seqlens=(0, 100, 256), window_size=(150, 0))
    out, lse = burstcu.attention(q, k, v, group, return_lse=True, **mask)
    burstcu.attention_backward(dout, q, k, v, out, lse, group, **mask)
    assert 6 <= len(set(launched)) <= emulate.POOLS_KEPT, len(set(launched))


def test_argument_checks(mod):
    fn = mod.get_function("probe_race<true>")
    out = np.zeros(32, np.int32)
    with pytest.raises(TypeError, match="numpy scalar"):
        mod.get_function("probe_errors")((1,), (32,), (7, out))
    with pytest.raises(RuntimeError, match="4-byte 'i'.*8-byte 'i'"):
        mod.get_function("probe_errors")((1,), (32,), (np.int64(7), out))
    with pytest.raises(RuntimeError, match="4-byte 'i'.*4-byte 'f'"):
        mod.get_function("probe_errors")((1,), (32,), (np.float32(7), out))
    with pytest.raises(RuntimeError, match="takes 1 argument"):
        fn((1,), (32,), (out, out), shared_mem=128)
    with pytest.raises(RuntimeError, match="1024"):
        fn((1,), (2048,), (out,))
    with pytest.raises(KeyError):
        mod.get_function("no_such_kernel")


# a numpy.void in the layout of kernels' ProbeArgs (pointers as addresses, C alignment)
PROBE_ARGS = np.dtype([("x", np.uint64), ("out", np.uint64), ("big", np.int64), ("n", np.int32),
                       ("f", np.float32)], align=True)


def test_struct_argument(mod):
    nt = 64
    x = np.arange(nt, dtype=np.int32) - 7
    out = np.zeros((nt, 3), np.int64)
    args = np.zeros(1, PROBE_ARGS)
    args[0] = (x.ctypes.data, out.ctypes.data, 2**40 + 5, -3, 2.5)
    mod.get_function("probe_struct")((1,), (nt,), (args[0],))
    np.testing.assert_array_equal(out[:, 0], x * -3)
    np.testing.assert_array_equal(out[:, 1], 2**40 + 5 + np.arange(nt))
    np.testing.assert_array_equal(out[:, 2], 10)


def test_struct_argument_checks(mod):
    fn = mod.get_function("probe_struct")
    short = np.zeros(1, np.dtype([("x", np.uint64), ("out", np.uint64)]))
    with pytest.raises(RuntimeError, match="32-byte 's'.*16-byte 's'"):
        fn((1,), (32,), (short[0],))
    with pytest.raises(RuntimeError, match="32-byte 's'.*8-byte 'i'"):
        fn((1,), (32,), (np.int64(0),))


# ---------------------------------------------------------------------------------------------
# fp16 / bf16 conversion (round to nearest even) against numpy and ml_dtypes

TRICKY = [
    0.0, -0.0, 1.0, -1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, 1 + 2**-11, 1 + 3 * 2**-11,
    65504.0, 65519.99, 65520.0, 70000.0, 2**-14, 2**-24, 2**-25, 2**-25 * 1.5, 2**-26, 1e-8, 5.960464477539063e-08,
    3.3895313892515355e38, 3.4e38, 1.1754942e-38, 9.2e-41, 1e-45, 0.1, 1 / 3, -2.5e-3, 1234.567,
    float("inf"), float("-inf"), float("nan"),
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_half_and_bf16_conversion(mod):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(TRICKY, np.float32), rng.standard_normal(200).astype(np.float32) * 10.0 ** rng.integers(-6, 6, 200)])
    x = np.concatenate([x, np.frombuffer(rng.bytes(4 * 200), np.float32)]).astype(np.float32)  # random bit patterns
    n = x.size
    h, bf = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    ph, pbf = np.zeros(n, np.uint32), np.zeros(n, np.uint32)
    back = np.zeros((n, 2), np.float32)
    mod.get_function("probe_convert")((1,), (64,), (x, h, bf, ph, pbf, back, np.int32(n)))
    nan = np.isnan(x)
    want_h = x.astype(np.float16).view(np.uint16)
    want_bf = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(h[~nan], want_h[~nan])
    np.testing.assert_array_equal(bf[~nan], want_bf[~nan])
    assert np.isnan(h.view(np.float16)[nan]).all() and np.isnan(bf.view(ml_dtypes.bfloat16)[nan]).all()
    # pack2(lo, hi): lo in bits 0-15
    np.testing.assert_array_equal((ph & 0xFFFF)[~nan], want_h[~nan])
    np.testing.assert_array_equal((ph >> 16)[~nan], (-x).astype(np.float16).view(np.uint16)[~nan])
    np.testing.assert_array_equal((pbf >> 16)[~nan], (-x).astype(ml_dtypes.bfloat16).view(np.uint16)[~nan])
    np.testing.assert_array_equal(back[~nan, 0], x.astype(np.float16).astype(np.float32)[~nan])
    np.testing.assert_array_equal(back[~nan, 1], x.astype(ml_dtypes.bfloat16).astype(np.float32)[~nan])


# ---------------------------------------------------------------------------------------------
# the probes are real CUDA: they compile under NVRTC too (where cuda-python is installed)


def test_probes_compile_under_nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    pathfinder = pytest.importorskip("cuda.pathfinder")
    inc = pathfinder.find_nvidia_header_directory("cudart")
    if not inc:
        pytest.skip("no CUDA runtime headers")
    err, prog = nvrtc.nvrtcCreateProgram(PROBES.read_bytes(), b"emu_probes.cu", 0, [], [])
    for name in NAMES:
        nvrtc.nvrtcAddNameExpression(prog, name.encode())
    opts = [b"--gpu-architecture=sm_80", b"-std=c++17", f"-I{kernel_dir()}".encode(), f"-I{inc}".encode()]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")


# ---------------------------------------------------------------------------------------------
# speed (printed with -s; asserted only loosely, the machine is shared)


def test_speed_report(mod):
    iters, nt = 2000, 128
    out = np.zeros(nt, np.int32)
    before = mod.switch_count()
    t0 = time.perf_counter()
    mod.get_function("bench_syncwarp")((1,), (nt,), (np.int32(iters), out))
    dt = time.perf_counter() - t0
    switches = mod.switch_count() - before
    fo, uo = np.zeros(32, np.float32), np.zeros(32, np.uint32)
    t0 = time.perf_counter()
    mod.get_function("bench_mma")((1,), (32,), (np.int32(iters), fo))
    t_mma = (time.perf_counter() - t0) / iters
    t0 = time.perf_counter()
    mod.get_function("bench_ldmatrix")((1,), (32,), (np.int32(iters), uo))
    t_ld = (time.perf_counter() - t0) / iters
    print(f"\nemulator: {switches / dt / 1e6:.1f} M context switches/s; per warp: "
          f"mma {t_mma * 1e6:.2f} us, ldmatrix_x4 {t_ld * 1e6:.2f} us")
    assert fo[0] == 16.0 * iters and switches >= iters * nt * 31 // 32  # 31 lanes block per __syncwarp
    assert switches / dt > 1e6
