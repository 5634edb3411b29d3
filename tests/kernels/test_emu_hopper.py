"""Tests of the emulator's sm_90 machinery (kernels/emu/emu_hopper.h) through kernels/hopper.cuh:
mbarriers, bulk tensor copies (TMA) and when they land, bulk tensor reductions and their
bulk async-groups, named barriers, elect.sync, the vector reduction red.global.add.v2.f32, setmaxnreg, the warpgroup side of wgmma, and the deadlock report.

The probe kernels are in tests/kernels/emu_src/hopper_probes.cu. The expected shared-memory image
of a TMA box is rebuilt here from the definitions (PTX ISA "Tensors" / "Swizzling Modes", CUDA
driver cuTensorMapEncodeTiled): the box at the given coordinates, zeros outside the tensor, row-major
with dim 0 innermost, then the 16-byte chunks permuted by the address bits. The tensor maps are
packed here with `struct`, independently of burstcu/ops/cuda/tensor_map.py. The wgmma tests install a
stand-in for the math (hopper_probes.cu) so that only the scheduling is under test.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from burstcu.build.emulate import build_module
from tests.kernels.tma_model import box_values

pytestmark = pytest.mark.emulated

PROBES = Path(__file__).parent / "emu_src" / "hopper_probes.cu"
NAMES = ["probe_mbar", "probe_pipeline", "probe_named", "probe_elect", "probe_red", "probe_reduce",
         "probe_maxnreg", "probe_wgmma"]


@pytest.fixture(scope="module")
def mod():
    return build_module([PROBES], NAMES)


i32 = np.int32

# ---------------------------------------------------------------------------------------------
# tensor maps (the emulator's EmuTensorMap, 128 bytes, little-endian)

MAGIC = 0x3150414D54554342  # "BCUTMAP1"
SPAN = {0: 0, 1: 32, 2: 64, 3: 128}  # CUtensorMapSwizzle value -> swizzle span in bytes


def pack_map(ptr: int, dims, strides, box, swizzle: int, elem: int = 2) -> bytes:
    rank = len(dims)
    pad = 5 - rank
    return struct.pack("<QQ5Q5Q5IIII", MAGIC, ptr, *dims, *[1] * pad, *strides, *[0] * pad, *box, *[1] * pad,
                       rank, elem, swizzle)


def aligned_buffer(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


def maps_buffer(*maps: bytes) -> np.ndarray:
    buf = aligned_buffer(128 * len(maps))
    for i, m in enumerate(maps):
        buf[128 * i:128 * (i + 1)] = np.frombuffer(m, np.uint8)
    return buf


# ---------------------------------------------------------------------------------------------
# the model of a landed box


def swizzled(raw: bytes, span: int) -> np.ndarray:
    """The shared image of `raw` written at a pattern-aligned address with the TMA swizzle: 16-byte
    chunk index XOR the 128-byte line index (mod 2, 4, 8 for the 32, 64, 128-byte modes)."""
    src = np.frombuffer(raw, np.uint8)
    out = np.full(src.size, 0xAB, np.uint8)
    for o in range(0, src.size, 16):
        p = o ^ (((o >> 7) & (span // 16 - 1)) << 4) if span else o
        out[p:p + 16] = src[o:o + 16]
    return out


def test_swizzle_model_matches_the_isa_table():
    # PTX ISA, 128-byte swizzle: row r of 16-byte cells (128-byte lines) holds cells c ^ r
    raw = bytes(np.repeat(np.arange(64, dtype=np.uint8), 16))  # cell k filled with k
    img = swizzled(raw, 128).reshape(8, 8, 16)[:, :, 0]
    assert (img[1] == [9, 8, 11, 10, 13, 12, 15, 14]).all()
    assert (img[7] == [63, 62, 61, 60, 59, 58, 57, 56]).all()
    img64 = swizzled(raw[:512], 64).reshape(4, 8, 16)[:, :, 0]
    assert (img64[3] == [27, 26, 25, 24, 31, 30, 29, 28]).all()  # the 64B table's row 3: 3 2 1 0 7 6 5 4


# ---------------------------------------------------------------------------------------------
# mbarriers


def mbar_maps(keep: list) -> np.ndarray:
    g = (np.arange(4 * 32, dtype=np.uint16) + 1).reshape(4, 32)  # 4 rows of 32 halves
    big = np.arange(256 * 256, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    keep += [g, big]
    return maps_buffer(pack_map(g.ctypes.data, (32, 4), (2, 64), (32, 1), 0),  # 64-byte boxes
                       pack_map(big.ctypes.data, (64, 1), (2, 512), (64, 1), 3),  # 128B swizzle
                       pack_map(big.ctypes.data, (256, 256), (2, 512), (256, 256), 0)), g  # 128 KiB boxes


def test_mbarrier_phases_parity_and_tx(mod):
    keep: list = []
    maps, g = mbar_maps(keep)
    out = np.full(200, -1, np.int32)
    mod.get_function("probe_mbar")((1,), (32,), (i32(0), maps, i32(1024), out), shared_mem=2048)
    n = 0

    def take(k):
        nonlocal n
        n += k
        return list(out[n - k:n])

    assert take(8) == [1, 0, 0, 1, 0, 0, 0, 1]
    assert take(32) == list(g[0]) and take(32) == list(g[1])
    assert take(5) == [1, 0, 0, 0, 1]
    assert take(32) == list(g[2])  # a copy may complete before its expect_tx (tx-count goes negative)


MBAR_ERRORS = {
    1: r"holds no initialised mbarrier",
    2: r"arrival beyond the expected count: the mbarrier at shared offset 0x400 is in phase 0 \(parity 0\), 0 of 1 "
       r"arrivals pending, tx-count 64",
    3: r"tx-count overflow",
    4: r"already initialised",
    5: r"completed .* while a TMA copy that signals it is still in flight .*expect_tx byte count is smaller",
    6: r"ended with 1 TMA copies in flight",
    7: r"still in flight",
    8: r"would overwrite the mbarrier at shared offset 0x400",
    9: r"overwritten by an ordinary store",
    10: r"not inside the block's dynamic shared memory",
    11: r"not 128-byte aligned",
    12: r"not 1024-byte aligned",
    13: r"parity 2 is not 0 or 1",
    14: r"count must be in \[1, 2\^20 - 1\]",
    15: r"deadlock in block \(0,0,0\): 1 live thread\(s\).* Threads 0 spin on the mbarrier at shared offset 0x400 "
        r"waiting for the phase of parity 0: it is in phase 0 \(parity 0\), 1 of 1 arrivals pending, tx-count 0",
    16: r"underflows the tx-count",
    17: r"deadlock in block .* spin on the mbarrier at shared offset 0x400",
}


@pytest.mark.parametrize("mode", sorted(MBAR_ERRORS))
def test_mbarrier_errors(mod, mode):
    keep: list = []
    maps, _ = mbar_maps(keep)
    bar_off = 131072 if mode == 16 else 1024
    out = np.zeros(16, np.int32)
    with pytest.raises(RuntimeError, match=MBAR_ERRORS[mode]):
        mod.get_function("probe_mbar")((1,), (32,), (i32(mode), maps, i32(bar_off), out), shared_mem=bar_off + 64)


def test_bad_tensor_map(mod):
    keep: list = []
    maps, _ = mbar_maps(keep)
    maps[0] ^= 1  # the magic
    with pytest.raises(RuntimeError, match="not an emulator tensor map"):
        mod.get_function("probe_mbar")((1,), (32,), (i32(6), maps, i32(1024), np.zeros(4, np.int32)),
                                       shared_mem=2048)


# ---------------------------------------------------------------------------------------------
# the producer / consumer pipeline

BOX0 = {0: 24, 1: 16, 2: 32, 3: 64}  # elements of dim 0 per swizzle mode (48, 32, 64, 128 bytes)


def pipeline_case(rank: int, swizzle: int, keep: list):
    rng = np.random.default_rng(10 * rank + swizzle)
    b0 = BOX0[swizzle]
    if rank == 2:  # a (50, 80) view of a (50, 96) array: rows 192 bytes apart
        big = rng.integers(1, 60000, (50, 96)).astype(np.uint16)
        x = big[:, :80]
        L = x.T
        dims, strides, box = (80, 50), (2, 192), (b0, 16)
        coords = [(0, 0, 0, 0), (64, 40, 0, 0), (-8, -3, 0, 0), (8, 17, 0, 0), (72, 49, 0, 0)]
        keep.append(big)
    else:  # (B, S, H, D) = (2, 20, 3, 40), the attention layout: dims (D, S, H, B)
        x = rng.integers(1, 60000, (2, 20, 3, 40)).astype(np.uint16)
        L = x.transpose(3, 1, 2, 0)
        dims, strides, box = (40, 20, 3, 2), (2, 240, 80, 4800), (b0, 8, 2, 1)
        coords = [(0, 0, 0, 0), (32, 16, 2, 1), (-16, -4, -1, 0), (8, 5, 1, 1), (0, 12, 0, 2)]
        keep.append(x)
    m = maps_buffer(pack_map(x.ctypes.data, dims, strides, box, swizzle))
    box_bytes = 2 * int(np.prod(box))
    want = [swizzled(box_values(L, box, c[:rank]).tobytes(), SPAN[swizzle]) for c in coords]
    return m, np.array(coords, np.int32), box_bytes, want


def run_pipeline(mod, rank, swizzle, mode, ntiles=5, stages=2, **kw):
    keep: list = []
    m, coords, box_bytes, want = pipeline_case(rank, swizzle, keep)
    stage_bytes = (box_bytes + 1023) // 1024 * 1024
    out = np.zeros((ntiles, box_bytes), np.uint8)
    mod.get_function("probe_pipeline")(
        (1,), (384,), (i32(rank), m, coords, i32(ntiles), i32(stages), i32(stage_bytes), i32(box_bytes), i32(mode),
                       out), shared_mem=stages * stage_bytes + 16 * stages, **kw)
    return out, want, stages * stage_bytes


@pytest.mark.parametrize("rank", [2, 4])
@pytest.mark.parametrize("swizzle", [0, 1, 2, 3])
def test_pipeline_lands_boxes_with_oob_and_swizzle(mod, rank, swizzle):
    out, want, _ = run_pipeline(mod, rank, swizzle, mode=0)
    for t in range(len(want)):
        np.testing.assert_array_equal(out[t], want[t], err_msg=f"tile {t}")
    assert (want[1] == 0).any() and (want[2] == 0).any()  # the model has out-of-bound zeros to check


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pipeline_randomized(mod, seed):
    out, want, _ = run_pipeline(mod, 4, 3, mode=0, randomize=True, seed=seed)
    for t in range(len(want)):
        np.testing.assert_array_equal(out[t], want[t], err_msg=f"tile {t}")


def test_consumer_reading_before_its_wait_sees_poison(mod):
    out, want, _ = run_pipeline(mod, 4, 3, mode=1)
    assert (out[0] == 0xFF).all()  # nothing has landed: the poison (NaN as f16 / bf16 / f32)
    for t in range(1, len(want)):
        np.testing.assert_array_equal(out[t], want[t])


def test_wrong_parity_passes_early_with_stale_data(mod):
    out, want, _ = run_pipeline(mod, 2, 3, mode=2, ntiles=3)
    np.testing.assert_array_equal(out[0], want[0])
    np.testing.assert_array_equal(out[1], want[1])
    np.testing.assert_array_equal(out[2], want[0])  # tile 2 (stage 0, phase 1) read tile 0's bytes


def test_wrong_parity_deadlock_is_reported(mod):
    keep: list = []
    _, _, box_bytes, _ = pipeline_case(4, 3, keep)
    full0 = 2 * ((box_bytes + 1023) // 1024 * 1024)
    msg = (rf"deadlock in block \(0,0,0\): 256 live thread\(s\) are all blocked\. Threads 128-383 spin on the "
           rf"mbarrier at shared offset 0x{full0:x} waiting for the phase of parity 1: it is in phase 3 \(parity 1\), "
           rf"1 of 1 arrivals pending, tx-count 0\.")
    with pytest.raises(RuntimeError, match=msg):
        run_pipeline(mod, 4, 3, mode=3)


def test_consumer_skipping_full_waits_is_caught(mod):
    # nobody waits on full[0], so tile 0 never lands; when the producer re-arms stage 0 for tile 2, the
    # phase still waits for tile 0's bytes: its arrival is one too many
    with pytest.raises(RuntimeError, match=r"thread \(0,0,0\) .*mbar_arrive_expect_tx: an arrival beyond the "
                                           r"expected count: the mbarrier at shared offset 0x1000 is in phase 0 "
                                           r"\(parity 0\), 0 of 1 arrivals pending, tx-count 2048"):
        run_pipeline(mod, 4, 3, mode=4)


# ---------------------------------------------------------------------------------------------
# named barriers, elect.sync, setmaxnreg


@pytest.mark.parametrize("randomize", [False, True])
def test_named_barrier_ping_pong(mod, randomize):
    log = np.full(16, -1, np.int32)
    log[0] = 0
    mod.get_function("probe_named")((1,), (256,), (i32(0), i32(4), log), randomize=randomize, seed=5)
    assert log[0] == 8 and list(log[1:9]) == [0, 1] * 4


NAMED_ERRORS = {
    1: r"warp 0 reached bar.arrive 3, 64 a second time before barrier 3 completed",
    2: r"divergent named barrier in warp 0: lane 0 is at bar.sync 3, 64 while lane 16 is at bar.sync 4, 64",
    3: r"thread count must be a positive multiple of 32",
}


@pytest.mark.parametrize("mode", sorted(NAMED_ERRORS))
def test_named_barrier_errors(mod, mode):
    with pytest.raises(RuntimeError, match=NAMED_ERRORS[mode]):
        mod.get_function("probe_named")((1,), (64,), (i32(mode), i32(1), np.zeros(4, np.int32)))


def test_named_barrier_ignores_exited_lanes(mod):
    log = np.zeros(4, np.int32)
    mod.get_function("probe_named")((1,), (64,), (i32(4), i32(1), log))
    assert log[0] == 1


def test_named_barrier_deadlock_report(mod):
    # warpgroup 1 exits: barrier 1 waits for its 128 threads forever
    with pytest.raises(RuntimeError, match=r"deadlock in block \(0,0,0\): 128 live thread\(s\) are all blocked\. "
                                           r"Named barrier 1: 128 of 256 threads arrived \(warps 0-3\); threads 0-127 "
                                           r"wait in bar\.sync\."):
        mod.get_function("probe_named")((1,), (256,), (i32(5), i32(1), np.zeros(8, np.int32)))
    with pytest.raises(RuntimeError, match="the block has only 4 warps, so the barrier can never complete"):
        mod.get_function("probe_named")((1,), (128,), (i32(0), i32(1), np.zeros(8, np.int32)))


def test_elect_one(mod):
    out = np.full(64, -1, np.int32)
    mod.get_function("probe_elect")((1,), (64,), (i32(0), out))
    np.testing.assert_array_equal(out, (np.arange(64) % 32 == 0).astype(np.int32))
    with pytest.raises(RuntimeError, match="elect.sync"):
        mod.get_function("probe_elect")((1,), (64,), (i32(1), out))


def test_red_add_v2(mod):
    """Every add lands (64 threads on 8 pairs, 3 times each: no add lost between threads), each
    element of its pair; an address off 8 bytes is refused, as the ISA requires."""
    out = aligned_buffer(4 * 18).view(np.float32)
    mod.get_function("probe_red")((1,), (64,), (out, i32(8), i32(0), i32(3)))
    tid = np.arange(64)
    sums = np.array([3 * tid[tid % 8 == p].sum() for p in range(8)], np.float32)
    np.testing.assert_array_equal(out[:16:2], sums)
    np.testing.assert_array_equal(out[1:16:2], -sums)
    assert not out[16:].any()
    with pytest.raises(RuntimeError, match="red.global.add.v2.f32 address .* is not 8-byte aligned"):
        mod.get_function("probe_red")((1,), (64,), (out, i32(8), i32(1), i32(1)))


@pytest.mark.parametrize("swizzle", [0, 3])
@pytest.mark.parametrize("mode", [0, 1, 5, 6, 7])
def test_bulk_tensor_reduction(mod, swizzle, mode):
    """A box of float32 added into a (20, 40) tensor at (16, 12), past both of its ends: the shared
    image is the box swizzled as a bulk copy lands it (the model above); the elements inside the
    tensor gain the box's values once a reduction (mode 1: two, the first waited for alone; 6: only
    read before the thread exits, its writes landing then; 7: read by a wait_group.read 1 that an
    empty group committed after it leaves pending: empty groups count), the rest stay as they
    were, and the emulator counts each reduction."""
    rng = np.random.default_rng(swizzle)
    g = rng.standard_normal((20, 40)).astype(np.float32)
    before = g.copy()
    box = rng.standard_normal((16, 32)).astype(np.float32)   # rows x 32 floats = 128 bytes a row
    image = swizzled(box.tobytes(), SPAN[swizzle])
    m = maps_buffer(pack_map(g.ctypes.data, (40, 20, 1, 1), (4, 160, 3200, 3200), (32, 16, 1, 1), swizzle,
                              elem=4))
    counted = mod.global_adds()["bulk_reduce"]
    mod.get_function("probe_reduce")((1,), (64,), (m, image, i32(image.size), i32(16), i32(12), i32(mode)),
                                     shared_mem=4096)
    reductions = 2 if mode == 1 else 1
    assert mod.global_adds()["bulk_reduce"] - counted == reductions
    want = before.copy()
    want[12:, 16:] += box[:8, :24]
    if mode == 1:
        want[12:, 16:] += box[:8, :24]
    np.testing.assert_array_equal(g, want)


BULK_ERRORS = [  # (mode, c0, c1, the error)
    (2, 0, 0, r"exited with 1 bulk tensor reduction\(s\) not waited for"),
    (3, 0, 0, r"the shared source of a bulk tensor reduction \(offsets 0x0\.\.0x7ff\) changed between its issue"),
    (4, 0, 0, r"tma_reduce_add after a named barrier that threads passed without fence_proxy_async"),
    (0, 0, -4, r"coordinate -4 along dim 1 is negative"),
    (8, 0, 0, r"its source \(shared offsets 0x0\.\.0x7ff\) holds the mbarrier at 0x100"),
    (9, 0, 0, r"tma_reduce_add from shared offsets 0x0\.\.0x7ff while a bulk copy into 0x0\.\.0x7ff is in flight"),
    (10, 0, 0, r"tma_load into shared offsets 0x0\.\.0x7ff, the source of a bulk tensor reduction not yet waited"),
]


@pytest.mark.parametrize("mode,c0,c1,error", BULK_ERRORS)
def test_bulk_tensor_reduction_errors(mod, mode, c0, c1, error):
    """Exiting before the wait, rewriting the source before it, issuing after a barrier that a
    writer passed without fence.proxy.async, a negative coordinate, a source over an mbarrier, a
    source a bulk copy is still writing, and a bulk copy into a source not yet read are errors."""
    g = np.zeros((20, 40), np.float32)
    image = np.zeros(2048, np.uint8)
    m = maps_buffer(pack_map(g.ctypes.data, (40, 20, 1, 1), (4, 160, 3200, 3200), (32, 16, 1, 1), 3, elem=4))
    with pytest.raises(RuntimeError, match=error):
        mod.get_function("probe_reduce")((1,), (64,), (m, image, i32(image.size), i32(c0), i32(c1), i32(mode)),
                                         shared_mem=4096)


MAXNREG = {
    1: r"setmaxnreg 20: the register count must be in \[24, 256\] and a multiple of 8",
    2: r"warps 0 and 1 of warpgroup 0 executed different setmaxnreg instructions",
    3: r"warps 0 and 3 of warpgroup 0 executed 1 and 0 setmaxnreg",
}


def test_setmaxnreg(mod):
    out = np.zeros(256, np.int32)
    mod.get_function("probe_maxnreg")((1,), (256,), (i32(0), out))
    assert (out == 1).all()
    for mode, msg in MAXNREG.items():
        with pytest.raises(RuntimeError, match=msg):
            mod.get_function("probe_maxnreg")((1,), (256,), (i32(mode), out))
    with pytest.raises(RuntimeError, match="warpgroup 0 is incomplete"):
        mod.get_function("probe_maxnreg")((1,), (64,), (i32(0), out))


# ---------------------------------------------------------------------------------------------
# wgmma scheduling


def wgmma(mod, mode, nthreads=128, real=0):
    out = np.full((nthreads, 4), -1.0, np.float32)
    mod.get_function("probe_wgmma")((1,), (nthreads,), (i32(mode), i32(real), out), shared_mem=8192)
    return out


def test_wgmma_deferred_until_wait(mod):
    out = wgmma(mod, 0)
    assert (out[:, 0] == 100).all()  # read before the wait: the old accumulators
    assert (out[:, 1] == 2).all()    # 0 + 1, then + 1


def test_wgmma_wait_1_retires_only_older_groups(mod):
    out = wgmma(mod, 8)
    assert (out[:, 0] == 4).all() and (out[:, 1] == 50).all() and (out[:, 2] == 51).all()


def test_wgmma_no_second_fence_after_commit(mod):
    out = wgmma(mod, 11)  # fence, mma, commit, mma, commit (flash_fwd_sm90.cu's order): legal
    assert (out[:, 0] == 1).all() and (out[:, 1] == 54).all()


def test_wgmma_real_compute_is_wired(mod):
    out = wgmma(mod, 9, real=1)
    assert (out[:, :2] == 0).all()


WGMMA_ERRORS = {
    1: r"issued wgmma without a wgmma_fence",
    2: r"thread \(77,0,0\) of block \(0,0,0\) changed accumulator register d\[3\] \(from 100 to 7\)",
    3: r"exited with 1 wgmma op\(s\) of its warpgroup not retired by a wgmma_wait \(0 of them not even committed\)",
    4: r"exited with 1 wgmma op\(s\) .*\(1 of them not even committed\)",
    5: r"divergent warpgroup 0: thread \(32,0,0\) .* reached wgmma_commit while 32 thread\(s\) of its warpgroup wait "
       r"at wgmma_fence",
    6: r"issued wgmma with different operands",
    7: r"thread \(3,0,0\) of block \(0,0,0\) changed the A-fragment registers",
    13: r"the shared memory a wgmma \(op 1 of warpgroup 0, threads 0-127\) reads as its B operand changed while "
        r"the op was in flight: offset 0x1002 held 0x3f80 at the mma_async and 0x40a0 at the wgmma_wait",
    12: r"deadlock in block .* 32 wait at __syncthreads .* Warpgroup 0: 96 of 128 threads wait at wgmma_fence for "
        r"threads 96-127\.",
}


@pytest.mark.parametrize("mode", sorted(WGMMA_ERRORS))
def test_wgmma_errors(mod, mode):
    with pytest.raises(RuntimeError, match=WGMMA_ERRORS[mode]):
        wgmma(mod, mode)


@pytest.mark.parametrize("mode", [15, 16, 17])
def test_wgmma_reads_what_another_warpgroup_wrote_and_fenced(mod, mode):
    """Warpgroup 1 writes B's first float (3), fences, then meets warpgroup 0 at a named barrier
    (15) or arrives on the mbarrier warpgroup 0 waits on (16; 17: another lane of the warp
    arrives, after a __syncwarp): warpgroup 0's two ops see it."""
    out = wgmma(mod, mode, nthreads=256)
    assert (out[:128, 0] == 100).all() and (out[:128, 1] == 6).all()  # 0 + 3, then + 3


def test_wgmma_reading_unfenced_stores_is_an_error(mod):
    """The same with no fence.proxy.async after the write: the tensor cores read shared memory
    through the async proxy, so the store is not ordered before the wgmma (PTX ISA)."""
    with pytest.raises(RuntimeError, match=r"warpgroup 0 \(threads 0-127\) issued a wgmma whose B operand in "
                                           r"shared memory \(offset 0x1002: 0x4040\) was written by ordinary "
                                           r"stores with no fence_proxy_async between them and the "
                                           r"wgmma on a path the emulator follows"):
        wgmma(mod, 14, nthreads=256)


def test_wgmma_incomplete_warpgroup(mod):
    with pytest.raises(RuntimeError, match="warpgroup 0 .* is incomplete"):
        wgmma(mod, 10, nthreads=64)


def test_emulator_still_usable_after_errors(mod):
    test_wgmma_deferred_until_wait(mod)
    out, want, _ = run_pipeline(mod, 2, 1, mode=0)
    for t in range(len(want)):
        np.testing.assert_array_equal(out[t], want[t])
