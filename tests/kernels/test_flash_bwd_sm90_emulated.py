"""The Hopper backward (kernels/flash_bwd_sm90.cu: wgmma, TMA, mbarriers) on the CPU emulator, or
a GPU with BURSTCU_KERNEL_TEST_BACKEND=cupy, against float64.

On the "sm_90a" table `KernelOps.backward_step` runs flash_bwd_dkdv_sm90 in place of the mma.sync
dK/dV kernel (with atomic dQ, or without it beside the mma.sync dQ kernel in the deterministic
mode) for head dims whose native size is 64, 128 or 256. The cases and the tolerance (FlashAttention's
rule against float64) are test_flash_bwd_emulated.py's; each test also counts the launches, so a
silent fall back to the mma.sync kernels fails it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from burstcu.layout import Block
from burstcu.testing.reference import keep_from_blocks, softmax_stats_ref, step_backward_ref
from tests.kernels.backend import BACKEND, kernel_ops, seeded_kernel_dir
from tests.kernels.test_flash_bwd_emulated import CASES, DTYPES, assert_fa_rule, make_inputs, run_case
from tests.kernels.test_flash_fwd_emulated import _counting

pytestmark = pytest.mark.emulated

HOPPER = "flash_bwd_dkdv_sm90"


def hopper_ops(deterministic: bool = False, randomize: bool = False):
    """The sm_90a table, whose dQ is the Hopper kernel's atomic one at every head dim (at 256 the
    backward adds it in a pass of its own unless told: `KernelOps.dq_own_pass`)."""
    wrapper = kernel_ops(deterministic=deterministic, randomize=randomize, arch="sm_90a")
    wrapper.ops.dq_own_pass_headdims = ()
    return wrapper


def assert_launches(counts: dict, case: str, deterministic: bool) -> None:
    """One Hopper launch a Block; the mma.sync dK/dV kernel only as the careful twin of a Block
    with masked pairs (it returns at once: the flag is not set), the dQ kernel (deterministic)
    a launch a Block plus its twin."""
    blocks = [blk for call in CASES[case][5] for blk in call]
    masked = sum(blk.masked for blk in blocks)
    assert counts.get(HOPPER) == len(blocks), counts
    assert counts.get("flash_bwd_dkdv", 0) == masked, counts
    assert counts.get("flash_bwd_dq", 0) == ((len(blocks) + masked) if deterministic else 0), counts
    assert "flash_bwd_dkdv_steps" not in counts and "flash_bwd_dq_steps" not in counts, counts


# every case, head dim (64: 128-row query tiles; 128: 64-row ones; 256: 64-row tiles of 64 keys,
# the consumers splitting the head dims), dtype and mode at least once
@pytest.mark.parametrize("case,d,dtype,deterministic", [
    ("full_ragged", 128, "bfloat16", False),
    ("causal_offsets", 128, "float16", False),
    ("masked_rows", 64, "bfloat16", False),
    ("window_causal", 128, "float16", False),
    ("window_both", 64, "float16", True),
    ("window_left", 64, "float16", False),
    ("causal_query_tile_edge", 64, "float16", False),     # a query tile's last row, 128 rows
    ("window_query_tile_edge", 128, "bfloat16", True),    # ... 64 rows
    ("window_causal_tile_edge", 128, "float16", False),
    ("small_ragged", 64, "bfloat16", True),
    ("zigzag_two_calls", 128, "bfloat16", True),
    ("small_causal", 256, "bfloat16", False),   # 256: 64-key blocks, head dims split
    ("causal_offsets", 256, "float16", True),
])
def test_step_matches_reference(case, d, dtype, deterministic):
    ops = hopper_ops(deterministic)
    counts = _counting(ops)
    got, ref, naive = run_case(ops, dtype, d, case)
    assert_launches(counts, case, deterministic)
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(name, g, r, n)


@pytest.mark.skipif(BACKEND != "emulated", reason="seeded mistakes are the emulator's to catch")
def test_the_emulator_catches_a_missing_proxy_fence(tmp_path, monkeypatch):
    """dS goes to shared memory through ordinary (generic-proxy) stores and is read there by the
    dQ = dS K wgmma (async proxy): without the fence.proxy.async between, the emulator says so."""
    fence = "      fence_proxy_async();\n      named_bar_sync(kDsReadyBar, kConsumers);\n"
    unfenced = fence.replace("fence_proxy_async();", "")
    folder = seeded_kernel_dir(tmp_path, "flash_bwd_sm90.cu", fence, unfenced)
    monkeypatch.setenv("BURSTCU_KERNEL_DIR", str(folder))
    with pytest.raises(RuntimeError, match=f"{HOPPER}.*: warpgroup . .* issued a wgmma whose A operand .* "
                                           "was written by ordinary stores with no fence_proxy_async"):
        run_case(hopper_ops(), "bfloat16", 128, "full_ragged")


def test_head_dim_256_adds_dq_in_its_own_pass():
    """At a native head dim of 256 the sm_90a table's backward runs the Hopper dK/dV kernel without
    dQ, then flash_bwd_dq, in the atomic mode too (`KernelOps.dq_own_pass`: faster there): its
    launches say so, its gradients meet FlashAttention's rule and equal the deterministic mode's
    bit for bit. At 128 the atomic mode keeps the Hopper kernel's atomic dQ."""
    grads = {}
    for d, deterministic in ((256, False), (256, True), (128, False)):
        ops = kernel_ops(deterministic=deterministic, arch="sm_90a")
        assert ops.ops.dq_own_pass(d) is (d == 256 or deterministic)
        counts = _counting(ops)
        got, ref, naive = run_case(ops, "float16", d, "small_causal")
        assert_launches(counts, "small_causal", deterministic=d == 256)
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
            assert_fa_rule(f"{name}, d {d}", g, r, n)
        grads[d, deterministic] = got
    for name, a, b in zip(("dq", "dk", "dv"), grads[256, False], grads[256, True]):
        assert np.array_equal(a, b), name


def test_the_own_dq_pass_at_256_needs_the_hopper_kernel(monkeypatch):
    """`backward.step_kernels` (no kernel runs): at head dim 256 the atomic mode takes the pass of
    its own only where the Hopper kernel without dQ runs the step; where it cannot (a scale <= 0,
    the Hopper backward off, a list its dQ kernel cannot take by query range) dQ stays atomic, on
    the Hopper kernel where that one takes the step. The deterministic mode always has its pass."""
    from burstcu.ops.cuda import kernel_ops as kops
    from burstcu.ops.cuda.backward import step_kernels

    monkeypatch.setattr(kops, "SM90_MAX_RECTS", 1)                 # two Blocks: a list
    monkeypatch.setattr(kops, "SM90_MIN_FLOP_PER_RECT", float("inf"))
    one = [Block(0, 64, 0, 64, 0, 0, False)]
    # equal key ranges, query ranges that overlap unequally: a list by key, not by query
    by_key_only = [Block(0, 100, 0, 60, 0, 0, False), Block(50, 100, 0, 60, 0, 0, False)]

    def choice(blocks, scale=0.125, deterministic=False, hopper_on=True):
        ops = kernel_ops(deterministic=deterministic, arch="sm_90a").ops
        ops.sm90_backward = hopper_on
        families, hopper = step_kernels(ops, "float16", 256, blocks, (1, 150, 2, 256), scale)
        return [f for f, _ in families], hopper and hopper.family
    assert choice(one) == (["bwd_dkdv_nodq", "bwd_dq"], "bwd_dkdv_nodq_sm90")
    assert choice(one, scale=0.0) == (["bwd_dkdv"], None)
    assert choice(one, hopper_on=False) == (["bwd_dkdv"], None)
    assert choice(by_key_only) == (["bwd_dkdv"], "bwd_dkdv_sm90_list")
    assert choice(by_key_only, deterministic=True) == (["bwd_dkdv_nodq", "bwd_dq"], None)
    assert choice(one, scale=0.0, deterministic=True) == (["bwd_dkdv_nodq", "bwd_dq"], None)
    ops = kernel_ops(arch="sm_90a").ops
    assert [f for f, _ in step_kernels(ops, "float16", 128, one, (1, 64, 2, 128), 0.125, psum=True)[0]] \
        == ["bwd_dkdv_nodq", "bwd_dq"]                              # check=True's row sums need it
    nodq = ops.variant("bwd_dkdv_nodq_sm90", "float16", 256)
    monkeypatch.setitem(kops._SM90_FIRST_USE, ops._first_use_key(nodq), False)   # failed its check
    assert choice(one) == (["bwd_dkdv"], "bwd_dkdv_sm90")


def hopper_global_adds(ops, dq_adds: str, dtype: str, d: int, listed: bool = False) -> dict | None:
    """The emulator's counts of adds into global memory so far (atomicAdd calls, red.global.add.
    v2.f32, bulk tensor reductions) by the Hopper dK/dV kernel that `dq_adds` selects (each
    kernel is a module of its own); None on a GPU."""
    if BACKEND != "emulated":
        return None
    family = ("bwd_dkdv_bulk_sm90" if dq_adds == "bulk" else "bwd_dkdv_sm90") + ("_list" if listed else "")
    return ops.ops.function(ops.ops.variant(family, dtype, d).name).module.global_adds()


def adds_since(ops, before: dict | None, dq_adds: str, dtype: str, d: int, listed: bool = False) -> dict:
    """hopper_global_adds now minus `before` ({} on a GPU)."""
    if before is None:
        return {}
    now = hopper_global_adds(ops, dq_adds, dtype, d, listed)
    return {k: now[k] - before[k] for k in now}


def record_dq_adds(monkeypatch) -> list:
    """The dq_adds of every Hopper dK/dV launch from now on (BwdStepSm90Params: 1 one float an
    atomic add, 2 two, 3 bulk reductions), in order."""
    from burstcu.ops.cuda import backward

    seen, pack = [], backward.bwd_step_sm90_params

    def recorded(*args, **kw):
        params = pack(*args, **kw)
        seen.append(int(params["dq_adds"]))
        return params
    monkeypatch.setattr(backward, "bwd_step_sm90_params", recorded)
    return seen


@pytest.mark.parametrize("d", [64, 128])
def test_dq_added_in_pairs_singles_bulk_or_unaligned_rows(monkeypatch, d):
    """How the Hopper kernel adds dQ (`KernelOps.sm90_dq_adds`) where dq's rows sit on 16 bytes:
    two floats an atomic add (red.global.add.v2.f32), one, or bulk tensor reductions from a
    staging tile (the bulk family); for a dq whose rows do not (a view one float into its buffer:
    on the emulator, whose red_add_v2 fails on a misaligned address), one float an add in both
    families. Each meets FlashAttention's rule; on the emulator, which runs the blocks one after
    another and adds in one order, all agree bit for bit, and its counts show the device path
    that ran: red.global.add.v2.f32 alone for pairs (half as many as the singles' atomicAdds),
    bulk reductions alone for bulk, atomicAdd alone where the rows are not aligned."""
    seen = record_dq_adds(monkeypatch)
    b, sq, sk, h, hkv, calls = CASES["causal_offsets"]
    q, k, v, dout = make_inputs("float16", b, sq, sk, h, hkv, d, 3)
    blocks = [blk for call in calls for blk in call]
    mask = keep_from_blocks(blocks, sq, sk)
    lse, delta = (x.astype(np.float32) for x in softmax_stats_ref(q, k, v, dout, mask, 1 / np.sqrt(d)))
    ref = step_backward_ref(q, k, v, dout, lse, delta, mask, 1 / np.sqrt(d))
    naive = step_backward_ref(q, k, v, dout, lse, delta, mask, 1 / np.sqrt(d), dtype=np.float32,
                              round_to=DTYPES["float16"])
    modes = [("pairs", "pairs", 0, 2), ("singles", "singles", 0, 1), ("bulk", "bulk", 0, 3)]
    if BACKEND == "emulated":   # a GPU run's HostArrays copies dq into an aligned device array
        modes += [("unaligned", "pairs", 1, 1), ("bulk, unaligned", "bulk", 1, 1)]
    grads, device = {}, {}
    for name, adds, offset, dq_adds in modes:
        ops = hopper_ops()
        ops.ops.sm90_dq_adds = adds
        before = hopper_global_adds(ops, adds, "float16", d)
        counts = _counting(ops)
        ctx = ops.backward_init(k, v, 1 / np.sqrt(d))
        size = b * sq * h * d
        dq = np.zeros(size + 4, np.float32)[offset:offset + size].reshape(b, sq, h, d)
        del seen[:]
        for call in calls:
            ops.backward_step(ctx, q, dout, lse, delta, dq, call)
        assert counts.get(HOPPER) == len(blocks) and set(seen) == {dq_adds}, (name, counts, seen)
        grads[name] = (dq.copy(), *ops.backward_finalize(ctx, np.float32))
        device[name] = adds_since(ops, before, adds, "float16", d)
        for what, g, r, n in zip(("dq", "dk", "dv"), grads[name], ref, naive):
            assert_fa_rule(f"{what}, {name}", g, r, n)
    if BACKEND == "emulated":
        for name in grads:
            assert np.array_equal(grads[name][0], grads["pairs"][0]), name
        pairs = device["pairs"]["red_add_v2"]
        assert pairs > 0 and device["pairs"] == {"atomic_add": 0, "red_add_v2": pairs, "bulk_reduce": 0}
        singles = {"atomic_add": 2 * pairs, "red_add_v2": 0, "bulk_reduce": 0}
        assert device["singles"] == device["unaligned"] == device["bulk, unaligned"] == singles, device
        assert device["bulk"]["bulk_reduce"] > 0 and device["bulk"]["atomic_add"] == 0, device


def test_how_dq_is_added_follows_the_rows_and_the_head_dim():
    """backward._dq_adds: bulk reductions or pairs only where dq's rows sit on 16 bytes at
    non-negative strides (the bulk family's tensor map refuses negative ones), pairs only up to head
    dim 128 (the kernel's own limit); an unknown KernelOps.sm90_dq_adds is an error."""
    from burstcu.ops.cuda.backward import _dq_adds

    ops = hopper_ops().ops
    dq = np.zeros((1, 64, 2, 128), np.float32)
    for adds, family, d, want in (("pairs", "bwd_dkdv_sm90", 128, 2), ("singles", "bwd_dkdv_sm90", 128, 1),
                                  ("bulk", "bwd_dkdv_bulk_sm90", 128, 3), ("pairs", "bwd_dkdv_sm90", 256, 1)):
        ops.sm90_dq_adds = adds
        hopper = ops.variant(family, "float16", d)
        x = np.zeros((1, 64, 2, d), np.float32)
        assert _dq_adds(ops, hopper, x) == want, (adds, d)
        assert _dq_adds(ops, hopper, x[:, ::-1]) == 1 and _dq_adds(ops, hopper, x[..., 1:]) == 1
    ops.sm90_dq_adds = "bulky"
    with pytest.raises(ValueError, match="sm90_dq_adds is 'bulky'"):
        ops.hopper_backward("bwd_dkdv", "float16", 128, [Block(0, 64, 0, 64, 0, 0, False)], dq.shape, 0.1)
    from burstcu.ops.cuda.params import bwd_step_sm90_params
    maps = (np.zeros(128, np.uint8),) * 4 + (None,)
    stats = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(ValueError, match="needs dq's tensor map"):
        bwd_step_sm90_params(maps, stats, stats, dq, dq, dq, np.zeros(1, np.int32), None, 2, 2, 0.1,
                             dq_adds=3)


def test_head_dims_padded_to_64_and_128():
    """d = 40 and 100 run the Hopper kernel at 64 and 128 (zero-padded columns)."""
    for d in (40, 100):
        ops = hopper_ops()
        counts = _counting(ops)
        got, ref, naive = run_case(ops, "float16", d, "small_ragged")
        assert counts.get(HOPPER) == 1, (d, counts)
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
            assert_fa_rule(f"{name}, d {d}", g, r, n)


@pytest.mark.parametrize("arch,d,scale,n_blocks,hopper", [
    ("sm_90a", 64, 0.125, 1, "one"),
    ("sm_90a", 128, 0.125, 4, "one"),
    ("sm_90a", 100, 0.125, 1, "one"),    # runs at 128
    ("sm_90a", 32, 0.125, 1, None),      # native 32: the mma.sync kernel, not a padded 64
    ("sm_90a", 80, 0.125, 1, None),      # native 96
    ("sm_90a", 256, 0.125, 1, "one"),    # the consumers split the head dims, not the keys
    ("sm_90a", 200, 0.125, 1, "one"),    # runs at 256
    ("sm_90a", 64, 0.0, 1, None),        # scale <= 0: the kernel masks before scaling
    ("sm_90a", 64, 0.125, 5, "list"),    # many small Blocks: the Hopper list kernel
    ("sm_90a", 64, 0.0, 5, None),        # ... not at a scale <= 0
    ("sm_80", 64, 0.125, 1, None),       # another table
])
def test_which_kernel_runs_the_step(arch, d, scale, n_blocks, hopper):
    ops = kernel_ops(arch=arch).ops
    blocks = [Block(40 * i, 40, 40 * i, 40, 0, 0, False) for i in range(n_blocks)]
    for family in ("bwd_dkdv", "bwd_dkdv_nodq"):
        got = ops.hopper_backward(family, "float16", d, blocks, (1, 40 * n_blocks, 2, d), scale)
        want = {None: None, "one": family + "_sm90", "list": family + "_sm90_list"}[hopper]
        assert (got and got.family) == want, (family, got)
    ops.sm90_lists = False   # the mma.sync list kernels for a list
    assert ops.hopper_backward("bwd_dkdv", "float16", d, blocks, (1, 40 * n_blocks, 2, d), scale) is (
        None if hopper in (None, "list") else ops.variant("bwd_dkdv_sm90", "float16", d))
    ops.sm90_backward = False
    assert ops.hopper_backward("bwd_dkdv", "float16", 64, blocks[:1], (1, 40, 2, 64), 0.125) is None


def test_deterministic_mode_is_bitwise_repeatable():
    """dK, dV from the Hopper kernel (one writer a row, a fixed order) and dQ from the mma.sync dQ
    kernel: two runs give the same bits, also with the emulator's shuffled thread order."""
    runs = [run_case(hopper_ops(True, randomize=randomize), "bfloat16", 128, "causal_offsets")[0]
            for randomize in (False, True)]
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert np.array_equal(a, b), name


def test_rows_outside_the_block_are_never_read():
    """Inf/NaN in q, dO, k and v rows past a Block without masked pairs (the nonfinite flag is not
    even computed): the tensor maps cover the Block's rows only, so every gradient equals the run
    on the same inputs with those rows zeroed; the rows past the Block get no dk, dv."""
    B, S, H, HKV, D, n = 1, 200, 2, 1, 64, 150
    blocks = [Block(0, n, 0, n, 0, 0, False)]
    x = dict(zip(("q", "k", "v", "dout"), make_inputs("float16", B, S, S, H, HKV, D, seed=5)))
    bad = {name: a.copy() for name, a in x.items()}
    for name, value in (("q", np.nan), ("k", np.inf), ("v", np.nan), ("dout", -np.inf)):
        bad[name][:, n:] = value
        x[name][:, n:] = 0
    rng = np.random.default_rng(6)
    lse = rng.standard_normal((B, H, S)).astype(np.float32) + 6
    delta = rng.standard_normal((B, H, S)).astype(np.float32)
    grads = []
    for inputs in (x, bad):
        ops = hopper_ops()
        counts = _counting(ops)
        ctx = ops.backward_init(inputs["k"], inputs["v"], 0.125)
        dq = np.zeros((B, S, H, D), np.float32)
        ops.backward_step(ctx, inputs["q"], inputs["dout"], lse, delta, dq, blocks)
        assert counts == {HOPPER: 1}, counts
        grads.append((dq, *ops.backward_finalize(ctx, np.float32)))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert np.isfinite(b).all(), name
        assert np.array_equal(a, b), name
    assert not grads[1][1][:, n:].any() and not grads[1][2][:, n:].any()


@pytest.mark.skipif(BACKEND != "emulated", reason="the check's own path, on the emulator")
@pytest.mark.parametrize("broken", [False, True])
def test_first_use_check(monkeypatch, broken):
    """On a GPU the first use of a Hopper backward variant runs a step with it and with the
    mma.sync kernels (`KernelOps._sm90_backward_checked`). A correct kernel passes silently and
    is used; one whose results differ (here: launched with twice the softmax scale) warns, and
    the process keeps the mma.sync kernels for that variant, so the caller's gradients are right."""
    from burstcu.ops.cuda import backward as backward_module
    from burstcu.ops.cuda import kernel_ops as kops

    ops = hopper_ops()
    ops.ops.first_use_check = True  # as on a GPU
    hopper = ops.ops.variant("bwd_dkdv_sm90", "bfloat16", 64)
    key = ops.ops._first_use_key(hopper)
    kops._SM90_FIRST_USE.pop(key, None)
    if broken:
        launch = backward_module._launch_hopper
        monkeypatch.setattr(backward_module, "_launch_hopper",
                            lambda o, v, operands, blk, flag, scale, heads:
                            launch(o, v, operands, blk, flag, 2 * scale, heads))
    try:
        counts = _counting(ops)
        if broken:
            with pytest.warns(RuntimeWarning, match="Hopper backward kernel .* failed its first-use") as seen:
                got, ref, naive = run_case(ops, "bfloat16", 64, "small_causal")
            # at the line that called the op's backward step, not inside burstcu/ops
            assert all("burstcu/ops" not in w.filename for w in seen), [w.filename for w in seen]
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning: it passes
                got, ref, naive = run_case(ops, "bfloat16", 64, "small_causal")
        assert kops._SM90_FIRST_USE[key] is not broken
        assert counts.get(HOPPER) == (1 if broken else 2), counts   # the check's, then the step's
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
            assert_fa_rule(name, g, r, n)
    finally:
        kops._SM90_FIRST_USE.pop(key, None)


@pytest.mark.parametrize("status, falls_back", [(1, True), (700, False), (719, False)])
def test_a_first_use_check_meeting_a_sticky_cuda_error_raises(status, falls_back):
    """A kernel that fails its first-use check with an ordinary launch error (cudaErrorInvalid-
    Value, 1) falls back to the mma.sync kernels with a warning; one that leaves the GPU context
    unusable (an illegal address, 700; a launch failure, 719) cannot fall back to anything: the
    check raises, saying so, and records no verdict."""
    from burstcu.ops.cuda import kernel_ops as kops

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    def run():
        raise CUDARuntimeError(status)
        yield  # pragma: no cover

    hopper = kops.KernelOps("emulated", arch="sm_90a").variant("bwd_dkdv_sm90", "float16", 64)
    key = ("test", status)
    try:
        if falls_back:
            with pytest.warns(RuntimeWarning, match="failed its first-use check on this GPU"):
                assert kops._first_use_check(key, hopper, "backward", run) is False
            assert kops._SM90_FIRST_USE[key] is False
        else:
            with pytest.raises(RuntimeError, match=r"a CUDA error that leaves this process's GPU "
                                                   r"context unusable \(CUDARuntimeError: status"):
                kops._first_use_check(key, hopper, "backward", run)
            assert key not in kops._SM90_FIRST_USE
    finally:
        kops._SM90_FIRST_USE.pop(key, None)


@pytest.mark.skipif(BACKEND != "emulated", reason="the check's own path, on the emulator")
def test_first_use_check_runs_the_variant_it_judges():
    """The deterministic mode's variant (no dQ) is checked by a step that runs it, not by one
    through the atomic-dQ variant: only its verdict is recorded."""
    from burstcu.ops.cuda import kernel_ops as kops

    ops = hopper_ops(deterministic=True)
    ops.ops.first_use_check = True
    keys = {with_dq: ops.ops._first_use_key(ops.ops.variant(family, "float16", 128))
            for with_dq, family in ((True, "bwd_dkdv_sm90"), (False, "bwd_dkdv_nodq_sm90"))}
    for key in keys.values():
        kops._SM90_FIRST_USE.pop(key, None)
    try:
        counts = _counting(ops)
        got, ref, naive = run_case(ops, "float16", 128, "small_causal")
        assert kops._SM90_FIRST_USE.get(keys[False]) is True and keys[True] not in kops._SM90_FIRST_USE
        assert counts.get(HOPPER) == 2 and not ops.ops._sm90_checking, counts
        for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
            assert_fa_rule(name, g, r, n)
    finally:
        for key in keys.values():
            kops._SM90_FIRST_USE.pop(key, None)


@pytest.mark.skipif(BACKEND != "emulated", reason="stands in for a GPU's loaded kernels")
@pytest.mark.parametrize("first_use_check", [True, False])
def test_a_hopper_backward_without_its_registers_is_never_launched(monkeypatch, first_use_check):
    """A Hopper backward whose loaded kernel could not run its setmaxnreg split (another
    NVRTC's build: `KernelOps._registers_problem`) warns at the caller's line, is never launched
    (it would hang the GPU), and the mma.sync kernels give the caller's gradients."""
    from tests.kernels.test_flash_fwd_sm90_emulated import BURSTCU, _refusing

    _refusing(monkeypatch, "was built with 128 registers a thread")
    ops = hopper_ops()
    ops.ops.first_use_check = first_use_check
    counts = _counting(ops)
    with pytest.warns(RuntimeWarning, match="Hopper backward kernel .* failed its first-use check "
                                            r"on this GPU \(.*128 registers") as seen:
        got, ref, naive = run_case(ops, "bfloat16", 64, "small_causal")
    assert all(not str(Path(w.filename).resolve()).startswith(BURSTCU) for w in seen), \
        [w.filename for w in seen]
    assert not any("sm90" in name for name in counts), counts
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(name, g, r, n)
