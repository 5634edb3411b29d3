"""Launcher of the decode kernels (kernels/flash_decode.cu) on the kernel backends (CuPy, or the
CPU emulator): this rank's partial attention of the new tokens over its valid cache rows, in
the format of `burstcu.ops.decode.partial` (acc (B,T,H,D), m (B,H,T) natural log, l (B,H,T),
float32), so the ranks' partials merge alike. The cache is contiguous (B, S, Hkv, D) or paged
(`burstcu.ops.decode.PagedRows`: the kernel reads through the page table, int32 on the op's
device; only the entries covering each batch row's valid rows are read, and trusted).

The split kernel (`choose_split_variant`): the tensor-core twin `flash_decode_split_mma` where the
dtype is float16 or bfloat16 and the head dim a multiple of 16 up to 256 (query rows of a kv head,
H / Hkv x T, under 16 fill a block of 16 with zero rows; `KernelOps.decode_mma_min_rows`, see
MMA_MIN_ROWS), else the CUDA-core `flash_decode_split`; both write the same workspace.
`split_kernel(ops)` names the one the op's latest call ran.

Splits (`num_splits`, FlashAttention's heuristic): a launch has B x Hkv x row groups blocks a
split; when they fill less than 80% of the device's block slots (SMs x `blocks_per_sm`: as many
split blocks as an SM's shared memory, and on a GPU its registers, hold; the emulator reports a
fixed SM count and the shared memory of its tile table's GPU), the longest batch row's keys are
cut into the split count, up to MAX_SPLITS, whose waves of blocks come closest to whole (within
85% of the best), each split at least MIN_KEYS keys, a multiple of the kernel's tile (BK, or the
twin's 32 or 64 keys). The split kernel writes every split's (m, l, acc) to a workspace that the
combine kernel reduces (a decode of one rank, `whole`: the finish kernel, which ends the decode
there); the workspace holds `most_splits` splits of the shape, the most the heuristic can give for
any lengths up to the cache's rows (1 when the blocks of one split fill the device: a large batch
pays nothing for splits it never takes).

Host path: a `_Plan` per shape (the split kernel chosen, variants, grid, block slots, the
parameter structs packed once with every field that does not change between calls) is kept on
the op; a call writes only the pointers, the lengths' address and the split count into its
copy of the packed structs (`CStruct.setter`). The workspace and the outputs live in the op's kept buffers
(`LocalOps.double_buffer`, freed by `release_buffers`); the two buffers of a layout are taken in
turn, the turn kept with the pair itself (not with a plan: plans of other scales, strides or a
paged cache may share a layout), so a call's partial stays valid through the op's next call. On
a GPU the lengths travel through a ring of pinned host buffers, copied asynchronously on the
current stream (an event guards a slot's reuse): no allocation and no host synchronisation. The
merge keeps its kernel and a struct template per shape (`_merge_launch`); a call copies the
template with its five addresses.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from ...build.compile import ARCH_LIMITS, device_attribute
from ...build.decode_variants import BK, MMA_DTYPES, MMA_HEADDIMS, MMA_ROWS, mma_family
from ..base import buffer_layout, dtype_name
from ..decode import PagedRows
from ..decode import merge as array_merge
from ..decode import partial as array_partial
from .params import MAX_GRID_YZ, CStruct, data_ptr, element_strides, rows_on_16_bytes

DECODE_SPLIT = CStruct("DecodeSplitParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("lengths", "ptr"), ("page_table", "ptr"),
    ("ws_m", "ptr"), ("ws_l", "ptr"), ("ws_acc", "ptr"), ("q_sb", "i64"), ("q_st", "i64"),
    ("q_sh", "i64"), ("k_sb", "i64"), ("k_ss", "i64"), ("k_sh", "i64"), ("pt_sb", "i64"),
    ("T_", "i32"), ("H", "i32"), ("Hkv", "i32"), ("D", "i32"), ("chunk", "i32"),
    ("splits", "i32"), ("page_size", "i32"), ("vec", "i32"), ("scale_log2", "f32")],
    templated=True)
DECODE_COMBINE = CStruct("DecodeCombineParams", [
    ("ws_m", "ptr"), ("ws_l", "ptr"), ("ws_acc", "ptr"), ("acc", "ptr"), ("m", "ptr"),
    ("l", "ptr"), ("T_", "i32"), ("H", "i32"), ("D", "i32"), ("splits", "i32")])
DECODE_FINISH = CStruct("DecodeFinishParams", [
    ("ws_m", "ptr"), ("ws_l", "ptr"), ("ws_acc", "ptr"), ("out", "ptr"), ("lse", "ptr"),
    ("T_", "i32"), ("H", "i32"), ("D", "i32"), ("splits", "i32")])
DECODE_MERGE = CStruct("DecodeMergeParams", [
    ("acc", "ptr"), ("m", "ptr"), ("l", "ptr"), ("out", "ptr"), ("lse", "ptr"),
    ("rank_stride", "i64"), ("T_", "i32"), ("H", "i32"), ("D", "i32"), ("ranks", "i32")])
DECODE_STRUCTS = (DECODE_SPLIT, DECODE_COMBINE, DECODE_FINISH, DECODE_MERGE)
# what a call writes into its copy of a plan's struct templates (`CStruct.setter`)
_fill_split = DECODE_SPLIT.setter(("q", "k", "v", "lengths", "page_table", "ws_m", "ws_l", "ws_acc",
                                   "chunk", "splits"))
_fill_combine = DECODE_COMBINE.setter(("ws_m", "ws_l", "ws_acc", "acc", "m", "l", "splits"))
_fill_finish = DECODE_FINISH.setter(("ws_m", "ws_l", "ws_acc", "out", "lse", "splits"))
_fill_merge = DECODE_MERGE.setter(("acc", "m", "l", "out", "lse"))

MAX_SPLITS = 128      # splits a batch row at most
MIN_KEYS = 128        # keys a split reads at least (2 to 4 tiles: the ring's fill pays off)
KERNEL_DTYPES = ("float16", "bfloat16", "float32")
PLANS_KEPT = 8        # shapes whose launch plans an op keeps
PINNED_SLOTS = 8      # pinned host buffers of the lengths (GPU), taken in turn
# The fewest query rows a kv head (H / Hkv x T) that take the tensor-core twin (`KernelOps.
# decode_mma_min_rows`; 16 keeps the CUDA-core kernel under one m16 tile, as before). On an H200
# (bench/results/h200/run7, 32/8 heads, d = 128, fp16) the twin on 32 rows (T = 8) took 0.226 /
# 1.85 ms a call at 64K / 1M cache rows, the CUDA-core kernel on 4 rows (T = 1) 0.283 / 2.73 ms:
# the same bytes, an eighth of the rows. That the twin on 4 rows is at least as fast as on 32 is
# a PREDICTION (memory-bound at either), not yet timed (bench/decode.py --mma-min-rows 16 times
# the CUDA-core kernel beside it).
MMA_MIN_ROWS = 1
# Occupancy (CUDA occupancy calculator, cc 8.0 - 9.0): the driver reserves 1 KB of shared memory
# a block; registers go to warps in units of 256.
RESERVED_SMEM = 1024
REG_UNIT = 256
ATTR_SMEM_PER_SM = 81   # cudaDevAttrMaxSharedMemoryPerMultiprocessor
ATTR_REGS_PER_SM = 82   # cudaDevAttrMaxRegistersPerMultiprocessor


def blocks_per_sm(smem_bytes: int, smem_per_sm: int, threads: int = 128, regs_per_thread: int = 0,
                  regs_per_sm: int = 65536) -> int:
    """Blocks of `threads` threads and `smem_bytes` dynamic shared memory an SM holds at once:
    as many as its `smem_per_sm` bytes fit (each block also takes RESERVED_SMEM), and, when
    `regs_per_thread` is known (> 0), as many as its registers fit (a warp's rounded up to
    REG_UNIT); at least 1. E.g. 86016 B (fp16, D = 256) on an A100's 167936 B: 1; 72704 B
    (fp16, D = 128) on an H100's 233472 B: 3."""
    fits = smem_per_sm // (smem_bytes + RESERVED_SMEM)
    if regs_per_thread > 0:
        warp_regs = -(-regs_per_thread * 32 // REG_UNIT) * REG_UNIT
        fits = min(fits, regs_per_sm // (warp_regs * -(-threads // 32)))
    return max(1, int(fits))


def _block_slots(ops, split_fn, launch) -> int:
    """Split blocks the op's device holds at once: SMs x `blocks_per_sm` of the split variant
    (on a GPU the device's shared memory and registers an SM and the compiled kernel's
    registers; under the emulator its SM count and the shared memory of its table's GPU)."""
    if ops.device == "cuda":
        per_sm = blocks_per_sm(launch.smem_bytes, device_attribute(ATTR_SMEM_PER_SM), launch.threads,
                               int(getattr(split_fn, "num_regs", 0)), device_attribute(ATTR_REGS_PER_SM))
    else:
        per_sm = blocks_per_sm(launch.smem_bytes, ARCH_LIMITS[ops.arch]["smem_per_sm"], launch.threads)
    return int(ops.sm_count) * per_sm


@lru_cache(maxsize=4096)
def num_splits(blocks: int, slots: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """FlashAttention's split heuristic: 1 when `blocks` (blocks a split) fill 80% of the
    device's `slots`; else the smallest split count (at most max_splits, slots and key_blocks,
    the longest row's keys in units of MIN_KEYS) whose wave efficiency (blocks * splits / slots
    over its ceiling) is within 85% of the best, among counts that change the keys a split."""
    if blocks >= 0.8 * slots:
        return 1
    top = max(1, min(max_splits, slots, key_blocks))

    def eligible(s: int) -> bool:
        return s == 1 or -(-key_blocks // s) != -(-key_blocks // (s - 1))

    def efficiency(s: int) -> float:
        waves = blocks * s / slots
        return waves / np.ceil(waves)

    best = max(efficiency(s) for s in range(1, top + 1) if eligible(s))
    return next(s for s in range(1, top + 1) if eligible(s) and efficiency(s) >= 0.85 * best)


def splits_for(longest: int, blocks_per_split: int, slots: int, tile: int = BK) -> tuple[int, int]:
    """(chunk, splits) for a longest batch row of `longest` valid keys when each split makes
    `blocks_per_split` blocks (B x Hkv x row groups) on a device of `slots` block slots (SMs x
    blocks_per_sm): chunk a multiple of `tile` (the split kernel's keys a tile, BK or the tensor-
    core twin's), splits * chunk >= longest, splits <= MAX_SPLITS."""
    key_blocks = max(1, -(-longest // MIN_KEYS))
    splits = num_splits(blocks_per_split, slots, key_blocks)
    chunk = -(-max(-(-max(longest, 1) // splits), 1) // tile) * tile
    return chunk, max(1, -(-longest // chunk))


def most_splits(rows: int, blocks_per_split: int, slots: int) -> int:
    """The most splits `splits_for` gives for any longest row of at most `rows` keys: 1 when
    the blocks of one split fill 80% of the slots, else min(MAX_SPLITS, slots, rows in units of
    MIN_KEYS) (`num_splits` never goes past it, and the chunk it rounds up never adds one)."""
    if blocks_per_split >= 0.8 * slots:
        return 1
    return max(1, min(MAX_SPLITS, slots, -(-rows // MIN_KEYS)))


def choose_split_variant(ops, dtype: str, rows: int, headdim: int):
    """The split kernel's variant for `rows` (= H / Hkv x T) query rows a kv head at `headdim`:
    the tensor-core twin (families decode_mma16/32/64) where dtype is float16 or bfloat16, the
    head dim a multiple of 16 up to 256 and rows >= `ops.decode_mma_min_rows`, with the fewest
    rows a block of at least min(rows rounded up to 16, 64) that the table has (more row groups
    past 64); else the CUDA-core kernel ("decode"). Raises ValueError when the table has neither."""
    if (dtype in MMA_DTYPES and rows >= ops.decode_mma_min_rows and headdim % 16 == 0
            and headdim <= MMA_HEADDIMS[-1]):
        want = min(-(-rows // 16) * 16, MMA_ROWS[-1])
        for block in MMA_ROWS:
            if block >= want:
                try:
                    return ops.variant(mma_family(block), dtype, headdim)
                except ValueError:      # not in this table (over its shared memory)
                    continue
    return ops.variant("decode", dtype, headdim)


def grid_problem(ops, q_shape: tuple, k_shape: tuple, dtype: str) -> str | None:
    """Why the split kernel's grid (splits, Hkv x row groups, B) cannot hold q (B,T,H,D) over a
    cache (B,S,Hkv,D) of `dtype` (CUDA's 65535 in y and z), or None (the array path, where no
    split variant runs it, has no such limit)."""
    b, t, h, d = q_shape
    hkv = k_shape[2]
    if dtype not in KERNEL_DTYPES:
        return None
    try:
        split = choose_split_variant(ops, dtype, h // hkv * t, d)
    except ValueError:
        return None
    if b > MAX_GRID_YZ:
        return (f"batch {b}: the CUDA decode kernels take at most {MAX_GRID_YZ} batch rows a call "
                f"(their grid's z); decode the batch in parts")
    blocks = hkv * -(-(h // hkv * t) // split.launch.block_m)
    if blocks > MAX_GRID_YZ:
        return (f"{h} heads x {t} new tokens: the CUDA decode kernel's grid would need {blocks} "
                f"blocks in y, past CUDA's {MAX_GRID_YZ}; decode fewer new tokens a call")
    return None


def split_kernel(ops) -> str | None:
    """The split kernel's name expression of the op's latest decode call through the kernels
    (its plan is the last one used), or None when it has made none; a later call on the array
    path (float64) leaves it as it was."""
    plans = ops.__dict__.get("_decode_plans")
    plan = next(reversed(plans.values()), None) if plans else None
    return plan.name if plan is not None else None


@dataclass
class _Plan:
    """What one shape's launches share: variants, grid, block slots, packed structs, buffer
    layout (the workspace for `max_splits` splits of `rows` cache rows)."""

    split_fn: Any
    combine_fn: Any
    split_grid: tuple
    combine_grid: tuple
    threads: tuple
    combine_threads: tuple
    smem: int
    groups: int
    slots: int
    rows: int                               # cache rows a batch row: lengths[b] <= rows
    tile: int                               # keys a tile of the split kernel (chunk's unit)
    name: str                               # the split kernel's name expression
    max_splits: int
    fields: list
    layout: tuple                           # buffer_layout(fields), made once
    split: bytes                            # DECODE_SPLIT with its static fields set
    combine: bytes                          # DECODE_COMBINE
    calls: int = 0                          # GPU: which pinned slot the next call takes
    pinned: Any = None                      # GPU: (PINNED_SLOTS, B) int32 pinned host memory
    device_lengths: Any = None              # GPU: (PINNED_SLOTS, B) int32, their copies
    events: list = field(default_factory=list)
    finishes: dict = field(default_factory=dict)   # out dtype: `_finish_launch`


def _plan(ops, q, k, page_table, vec: int, scale: float, kernel_dtype: str) -> _Plan | None:
    """The launch plan of q (B,T,H,D) over k (B,S,Hkv,D) or paged k (P,page,Hkv,D), or None
    when no split variant of this table runs the head dim (the array path runs it)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    try:
        split = choose_split_variant(ops, kernel_dtype, h // hkv * t, d)
    except ValueError:
        return None
    combine = ops.variant("decode_combine", "float32", d)
    split_fn = ops.function(split.name)
    groups = -(-(h // hkv * t) // split.launch.block_m)
    slots = _block_slots(ops, split_fn, split.launch)
    rows = k.shape[1] if page_table is None else page_table.shape[1] * k.shape[1]
    ms = most_splits(rows, hkv * groups * b, slots)
    qs, ks = element_strides(q), element_strides(k)
    ws = b * h * t * ms
    fields = [("decode_m", (ws,), np.float32), ("decode_l", (ws,), np.float32),
              ("decode_acc", (ws * d,), np.float32), ("decode_out_acc", (b, t, h, d), np.float32),
              ("decode_out_m", (b, h, t), np.float32), ("decode_out_l", (b, h, t), np.float32)]
    packed = np.zeros(1, DECODE_SPLIT.dtype)
    for name, value in (("q_sb", qs[0]), ("q_st", qs[1]), ("q_sh", qs[2]), ("k_sb", ks[0]),
                        ("k_ss", ks[1]), ("k_sh", ks[2]), ("T_", t), ("H", h), ("Hkv", hkv),
                        ("D", d), ("vec", vec), ("scale_log2", scale * np.log2(np.e))):
        packed[name] = value
    if page_table is not None:
        packed["pt_sb"] = element_strides(page_table)[0]
        packed["page_size"] = k.shape[1]
    combine_packed = np.zeros(1, DECODE_COMBINE.dtype)
    for name, value in (("T_", t), ("H", h), ("D", d)):
        combine_packed[name] = value
    plan = _Plan(split_fn, ops.function(combine.name), (1, hkv * groups, b), (t * h, b),
                 (split.launch.threads,), (combine.launch.threads,), split.launch.smem_bytes,
                 groups, slots, rows, split.launch.block_n, split.name, ms, fields,
                 buffer_layout(fields), packed.tobytes(), combine_packed.tobytes())
    if ops.device == "cuda":
        import cupyx
        import cupy
        plan.pinned = cupyx.empty_pinned((PINNED_SLOTS, b), np.int32)
        plan.events = [cupy.cuda.Event(disable_timing=True) for _ in range(PINNED_SLOTS)]
        plan.device_lengths = cupy.empty((PINNED_SLOTS, b), np.int32)
    return plan


def _device_lengths(ops, plan: _Plan, lengths):
    """The lengths (B,) int32 where the kernel reads them: on a GPU copied from the next pinned
    slot, asynchronously on the current stream (named: `set` would otherwise use its own
    default)."""
    host = np.asarray(lengths, np.int32)
    if ops.device != "cuda":
        return host
    slot = plan.calls % PINNED_SLOTS
    plan.calls += 1
    stream = ops.xp.cuda.get_current_stream()
    plan.events[slot].synchronize()          # returns at once unless the GPU is far behind
    plan.pinned[slot] = host
    plan.device_lengths[slot].set(plan.pinned[slot], stream=stream)
    plan.events[slot].record(stream)
    return plan.device_lengths[slot]


def _plan_for(ops, q, k, v, page_table, scale: float) -> _Plan | None:
    """The op's kept plan of this call's shape (made on first use)."""
    dtype = dtype_name(q)
    vec = int(rows_on_16_bytes(k, v) and (q.shape[3] * k.itemsize) % 16 == 0)
    key = (ops.stream_key(), ops.sm_count, ops.decode_mma_min_rows, dtype, q.shape, q.strides,
           k.shape, k.strides, page_table is not None and (page_table.shape, page_table.strides),
           vec, float(scale))   # strides in bytes
    return _kept(ops, "_decode_plans", key, lambda: _plan(ops, q, k, page_table, vec, float(scale), dtype))


def _kept(ops, store: str, key, make):
    """The value the op keeps under `key` in its `store` (an OrderedDict of the last PLANS_KEPT
    keys used), made by make() where it has none; a plan dropped waits for its pinned slots'
    copies first."""
    kept = ops.__dict__.setdefault(store, OrderedDict())
    value = kept.pop(key, None)
    if value is None:
        value = make()
    kept[key] = value
    while len(kept) > PLANS_KEPT:
        _, dropped = kept.popitem(last=False)
        for event in getattr(dropped, "events", ()):   # a plan's pinned lengths may still be
            event.synchronize()                         # copying: its memory returns to the pool
    return value


def _kernel_table(ops, table, b: int):
    """A paged cache's table as the kernel reads it: an int32 (B, max_pages) array of the op's
    module (on its device), entries of a row adjacent. Its entries are not read here (that
    would cost a copy to the host a call): KVCache fills the ones covering the valid rows."""
    xp = ops.xp
    if not isinstance(table, xp.ndarray):
        raise TypeError(f"a paged cache's table must be a {xp.__name__} array (the op's device), "
                        f"not {type(table).__module__}.{type(table).__name__}")
    if table.dtype != np.int32:
        raise TypeError(f"a paged cache's table must be int32, not {table.dtype}")
    if table.ndim != 2 or table.shape[0] != b:
        raise ValueError(f"a paged cache's table must be (batch={b}, max_pages), not {table.shape}")
    if ops.device == "cuda" and table.device.id != ops.current_device():
        raise ValueError(f"a paged cache's table is on device {table.device.id}; the op runs on "
                         f"device {ops.current_device()}")
    return table if element_strides(table)[1] == 1 else xp.ascontiguousarray(table)


def _turn(ops, pair, advance: bool) -> int:
    """Which buffer of the kept `pair` this call takes (0, 1, 0, ...): counted per pair, so
    every plan sharing the layout alternates with the others; a pair made anew starts at 0. A
    call that writes only the workspace (not advance) takes the buffer the next call will, so
    the partial in the other stays valid."""
    turns = ops.__dict__.setdefault("_decode_turns", weakref.WeakKeyDictionary())
    turn = turns.get(pair[0], 0)
    if advance:
        turns[pair[0]] = turn + 1
    return turn % 2


def partial(ops, q, k_cache, v_cache, lengths, scale: float, out=None):
    """(acc, m, l) of this rank's valid cache rows (module docstring); q (B,T,H,D), k_cache,
    v_cache (B,S,Hkv,D) or PagedRows of one dtype in KERNEL_DTYPES; lengths: host ints (B,),
    each at most the cache's rows a batch row. out: None, or (acc, m, l) C-contiguous float32
    arrays of those shapes on the op's device, which the combine kernel writes (returned; no
    copy). Else the arrays returned are the op's kept buffers: valid through the op's next
    `partial` or `whole` call, overwritten by a later one (copy them to keep them)."""
    if out is not None:
        _check_partial_out(out, q.shape)
    plan, split = _split(ops, q, k_cache, v_cache, lengths, scale, advance=out is None)
    if plan is None:
        if out is None:
            return split
        for dst, src in zip(out, split):
            ops.copy_(dst, src)
        return out
    buffers, ws, splits = split
    if out is None:
        out = (buffers["decode_out_acc"], buffers["decode_out_m"], buffers["decode_out_l"])
    args = _fill_combine(plan.combine, *ws, *(data_ptr(x) for x in out), splits)
    plan.combine_fn(plan.combine_grid, plan.combine_threads, (args,))
    return out


def _check_partial_out(out, q_shape: tuple) -> None:
    """ValueError unless out is (acc (B,T,H,D), m (B,H,T), l (B,H,T)) C-contiguous float32 for
    q of q_shape (what the combine kernel writes)."""
    b, t, h, d = q_shape
    shapes = ((b, t, h, d), (b, h, t), (b, h, t))
    if len(out) != 3 or any(tuple(x.shape) != shape or dtype_name(x) != "float32" or not x.flags.c_contiguous
                            for x, shape in zip(out, shapes)):
        raise ValueError(f"a decode partial's out must be C-contiguous float32 arrays of the shapes "
                         f"{shapes}, not {[(tuple(x.shape), dtype_name(x)) for x in out]}")


def whole(ops, q, k_cache, v_cache, lengths, scale: float, out_dtype):
    """(out (B,T,H,D) in out_dtype, lse (B,H,T) float32, new arrays): `merge` of `partial`'s
    partial alone, for a decode whose cache rows all lie here (one rank), in two launches: the
    split kernel, then flash_decode_finish (the combine's sums ended as the merge of one rank
    ends them) in place of combine and merge; the workspace only is written, so a partial the op
    returned before stays valid. Where the kernels lack out_dtype or no split variant runs the head
    dim, `merge` of `partial`."""
    out_name = dtype_name(np.dtype(out_dtype))
    if out_name not in KERNEL_DTYPES:
        return merge(ops, [partial(ops, q, k_cache, v_cache, lengths, scale)], out_dtype)
    plan, split = _split(ops, q, k_cache, v_cache, lengths, scale, advance=False)
    if plan is None:
        return merge(ops, [split], out_dtype)
    _, ws, splits = split
    fn, template = plan.finishes.get(out_name) or _finish_launch(ops, plan, q.shape, out_name)
    b, t, h, d = q.shape
    out = ops.xp.empty((b, t, h, d), dtype=out_name)
    lse = ops.xp.empty((b, h, t), dtype=np.float32)
    args = _fill_finish(template, *ws, data_ptr(out), data_ptr(lse), splits)
    fn(plan.combine_grid, plan.combine_threads, (args,))
    return out, lse


def _finish_launch(ops, plan: _Plan, shape: tuple, out_name: str) -> tuple:
    """(kernel, DECODE_FINISH's bytes with T_, H, D set) of the plan's finish into out_name,
    kept in the plan for the calls after the first."""
    _, t, h, d = shape
    packed = np.zeros(1, DECODE_FINISH.dtype)
    for name, value in (("T_", t), ("H", h), ("D", d)):
        packed[name] = value
    launch = plan.finishes[out_name] = (ops.function(ops.variant("decode_finish", out_name, 0).name),
                                        packed.tobytes())
    return launch


def _split(ops, q, k_cache, v_cache, lengths, scale: float, advance: bool) -> tuple:
    """The split kernel of `partial`'s arguments launched: (plan, (buffers, the workspace's
    three addresses, splits)), the workspace for a combine or a finish to reduce, in the kept
    buffer `_turn` gives (advance: the call takes its turn); or (None, the array path's
    partial) where no split variant of this table runs the head dim."""
    xp = ops.xp
    page_table, paged = None, (k_cache, v_cache)
    if isinstance(k_cache, PagedRows):
        page_table = _kernel_table(ops, k_cache.table, q.shape[0])
        k_cache, v_cache = k_cache.pages, v_cache.pages
    if q.strides[-1] != q.itemsize:
        q = xp.ascontiguousarray(q)
    if k_cache.strides[-1] != k_cache.itemsize or k_cache.strides != v_cache.strides:
        if page_table is not None:
            raise ValueError("paged k and v must share strides with a contiguous last dim")
        k_cache, v_cache = xp.ascontiguousarray(k_cache), xp.ascontiguousarray(v_cache)
    plan = _plan_for(ops, q, k_cache, v_cache, page_table, scale)
    if plan is None:     # a head dim this table has no split variant for
        if page_table is None:
            paged = (k_cache, v_cache)
        return None, array_partial(xp, q, *paged, lengths, scale, np.dtype(np.float32))
    longest = int(max(lengths)) if len(lengths) else 0
    if longest > plan.rows:   # the workspace holds the splits of plan.rows keys at most
        raise ValueError(f"lengths up to {longest} rows over a cache of {plan.rows} rows a batch row")
    chunk, splits = splits_for(longest, plan.split_grid[1] * q.shape[0], plan.slots, plan.tile)
    pair = ops.double_buffer(plan.fields, plan.layout)
    buffers = pair[_turn(ops, pair, advance)]
    device_lengths = _device_lengths(ops, plan, lengths)
    ws = (data_ptr(buffers["decode_m"]), data_ptr(buffers["decode_l"]), data_ptr(buffers["decode_acc"]))
    args = _fill_split(plan.split, data_ptr(q), data_ptr(k_cache), data_ptr(v_cache),
                       data_ptr(device_lengths), 0 if page_table is None else data_ptr(page_table),
                       *ws, chunk, splits)
    plan.split_fn((splits,) + plan.split_grid[1:], plan.threads, (args,), shared_mem=plan.smem)
    return plan, (buffers, ws, splits)


def merge(ops, parts, out_dtype):
    """(out (B,T,H,D) in out_dtype, lse (B,H,T) float32) of the ranks' partials [(acc, m, l) in
    rank order, as `partial` makes them] in one flash_decode_merge launch (any head dim), when
    they lie as one all-gather lays them: contiguous float32 on 4-byte addresses, each rank's
    at rank 0's plus one stride (or a single rank's); else, for an output dtype the kernel
    lacks, or past the grid's MAX_GRID_YZ batch rows, the array merge (`burstcu.ops.decode.merge`,
    whose steps the kernel follows in the same rank order). Every rank that merges the same
    partials makes the same choice and gets the same bits."""
    acc0, m0, l0 = parts[0]
    out_name = dtype_name(np.dtype(out_dtype))
    if out_name not in KERNEL_DTYPES or acc0.ndim != 4 or acc0.shape[0] > MAX_GRID_YZ:
        return array_merge(ops.xp, parts, out_dtype)
    stride = _rank_stride(parts)
    if stride is None:
        return array_merge(ops.xp, parts, out_dtype)
    b, t, h, d = acc0.shape
    fn, threads, template = _merge_launch(ops, out_name, acc0.shape, len(parts), stride)
    out = ops.xp.empty((b, t, h, d), dtype=out_name)
    lse = ops.xp.empty((b, h, t), dtype=np.float32)
    fn((t * h, b), threads, (_fill_merge(template, *(data_ptr(x) for x in (acc0, m0, l0, out, lse))),))
    return out, lse


def _merge_launch(ops, out_name: str, shape: tuple, ranks: int, stride: int) -> tuple:
    """(kernel, threads, DECODE_MERGE's bytes with its static fields set) of one merge shape,
    kept by the op (the last PLANS_KEPT shapes) for the calls after the first."""
    def make():
        _, t, h, d = shape
        packed = np.zeros(1, DECODE_MERGE.dtype)
        for name, value in (("rank_stride", stride), ("T_", t), ("H", h), ("D", d), ("ranks", ranks)):
            packed[name] = value
        variant = ops.variant("decode_merge", out_name, 0)
        return ops.function(variant.name), (variant.launch.threads,), packed.tobytes()

    key = (ops.current_device(), ops.stream_key(), out_name, tuple(shape), ranks, stride)
    return _kept(ops, "_decode_merges", key, make)


def _rank_stride(parts) -> int | None:
    """Floats from one rank's partial to the next when every (acc, m, l) is contiguous float32
    on a 4-byte address, of the shapes (B,T,H,D), (B,H,T), (B,H,T), and rank r's three arrays
    lie r strides past rank 0's (0 for one rank); None otherwise."""
    acc0 = parts[0][0]
    b, t, h, _ = acc0.shape
    for acc, m, l in parts:
        if (acc.shape != acc0.shape or m.shape != (b, h, t) or l.shape != (b, h, t)
                or any(x.dtype != np.float32 or not x.flags.c_contiguous or data_ptr(x) % 4
                       for x in (acc, m, l))):
            return None
    if len(parts) == 1:
        return 0
    step = data_ptr(parts[1][0]) - data_ptr(acc0)
    if step <= 0 or step % 4:
        return None
    for r, part in enumerate(parts):
        for x, x0 in zip(part, parts[0]):
            if data_ptr(x) - data_ptr(x0) != r * step:
                return None
    return step // 4
