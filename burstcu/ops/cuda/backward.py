"""Launchers of the backward kernels (kernels/flash_bwd.cu), called by `KernelOps`.

Shapes (B batch, Sq visiting query rows, Sk resident key rows, H query heads, Hkv kv heads,
D head dim): q, dout, out (B,Sq,H,D) in float16/bfloat16; k, v (B,Sk,Hkv,D); lse, delta (B,H,Sq)
float32; dq (B,Sq,H,D) float32 (the travelling accumulator); dk, dv accumulate in float32
(B,Sk,Hkv,Dp) inside the context, Dp the native head dim the kernels run at (D zero-padded).

`ops` supplies the array module (`ops.xp`), compiled kernels (`ops.function(name)`, called as
``fn(grid, block, (params,), shared_mem=...)`` with the kernel's parameter struct from
`burstcu.ops.cuda.params`), the non-finite flags and step launches (`ops.nonfinite_flag`,
`ops.step_flag`, `ops.launch_step`), the variant table
(`ops.variant(family, dtype, headdim)`), head-dim padding (`ops.pad_headdim`, `ops.unpad_headdim`)
and `ops.dq_own_pass(D)`: False launches one kernel that adds dQ with fp32 atomics (run-to-run
order varies); True (the deterministic mode, and the Hopper backward at head dim 256, where it
is faster) launches dK/dV and dQ kernels without atomics, so two runs give bit-identical results
(a second recomputation of S and dP: ~7/5 of the flops).

Launches a ring step: a step of one Block launches the per-rectangle kernels (flash_bwd_dkdv,
and flash_bwd_dq where dQ has its own pass) over it; a step of several launches each kernel once over
the whole list (flash_bwd_dkdv_steps over the Blocks grouped by key range, flash_bwd_dq_steps
grouped by query range; `params.step_group_lists`, one device buffer of rectangles a step (a
packed list's runs in arrays of their own), kept with the
context until it is finalized, and by the op while the step's `layout.StepBlocks` lives:
`KernelOps.step_lists`). The list kernels run each group's Blocks in order exactly as
one launch a Block would, so a deterministic step gives the same bits either way (for finite
inputs: the list runs the careful twins for all its Blocks when one is masked and an operand
holds a NaN/Inf). Within a step two Blocks' key ranges (and query ranges) are equal or
disjoint, as `burstcu.layout.blocks` makes them; other lists run a launch a Block
(`params.listable`). A list of many small Blocks may be packed instead (`ops.pack_lists`,
burstcu/ops/cuda/packing.py): tiles holding several Blocks' rows, each key's run of query rows
(dK/dV) or each row's run of keys (dQ) masking them; the same pairs, equal within rounding (not
bit for bit) to a launch a Block, and the step runs the careful pairs.

On the "sm_90a" table the Hopper dK/dV kernel (kernels/flash_bwd_sm90.cu: wgmma, TMA, warp
specialisation) takes the place of the mma.sync one where `KernelOps.hopper_backward` allows it
(head dims 64, 128 and 256, a softmax scale > 0, its first-use check passed on a GPU): a launch a
Block for a step of few or large Blocks, its list twin (flash_bwd_dkdv_steps_sm90) for a step of
many small ones; with atomic dQ, or beside the mma.sync dQ kernels where dQ has its own pass. A
Block with masked pairs (a list: one with masked pairs, or rows ending inside a tile, whose
neighbours its whole-array tensor maps read) pairs it with the mma.sync careful twin, of which the
nonfinite flag runs one: where it runs, the gradients a NaN/Inf cannot reach are the mma.sync
kernel's rounding, within FlashAttention's rule of the Hopper kernel's, not its bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...build.bwd_variants import LIST_SUFFIX, SM90_DKDV_BULK, SM90_DQ_BOX, delta_variant
from ...build.variants import CAREFUL_SUFFIX
from ...layout import Block
from ..base import dtype_name
from .params import (any_masked, block_column, bwd_delta_params, bwd_step_params,
                     bwd_step_sm90_params, cdiv, check_rows, element_strides, listable, nonempty,
                     rows_contiguous, rows_on_16_bytes, same_strides, vector_ready)
from .tensor_map import tensor_map_4d_rows

_KERNEL_DTYPES = ("float16", "bfloat16")


@dataclass
class BackwardContext:
    """The resident side of the backward ring on one rank.

    k, v: (B,Sk,Hkv,Dp) in the input dtype, padded to the native head dim Dp, 16-byte aligned.
    dk, dv: (B,Sk,Hkv,Dp) float32 accumulators. headdim: the caller's D. dtype: "float16" or
    "bfloat16". scale: the softmax scale. keep: what a launch still reads (the rectangle
    lists of the _steps kernels), kept until the context is finalized.
    """

    k: Any
    v: Any
    dk: Any
    dv: Any
    scale: float
    headdim: int
    dtype: str
    keep: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# helpers

def _kernel_dtype(x) -> str:
    name = dtype_name(x)
    if name not in _KERNEL_DTYPES:
        raise ValueError(f"the backward kernels take float16 or bfloat16 input, not {name}")
    return name


def _tile_rows(variant, tiled: str) -> int:
    """Rows a block of threads of `variant` owns: BN keys ("key") or BM queries ("query")."""
    return variant.launch.block_n if tiled == "key" else variant.launch.block_m


def _check_step(ctx: BackwardContext, q, dout, lse, delta, dq, blocks) -> None:
    """ValueError unless q, dout, lse, delta, dq and blocks fit each other and ctx."""
    for name, x in (("q", q), ("dout", dout)):
        if _kernel_dtype(x) != ctx.dtype:
            raise ValueError(f"{name} is {dtype_name(x)}, k was {ctx.dtype}")
    B, Sq, H, D = q.shape
    _, Sk, Hkv, _ = ctx.k.shape
    if D != ctx.headdim or H % Hkv or tuple(dout.shape) != tuple(q.shape):
        raise ValueError(f"q {tuple(q.shape)} / dout {tuple(dout.shape)} do not fit k with "
                         f"{Hkv} heads of dim {ctx.headdim}: H must be a multiple of Hkv")
    if tuple(dq.shape) != (B, Sq, H, D) or np.dtype(dq.dtype) != np.float32:
        raise ValueError(f"dq must be float32 {(B, Sq, H, D)}, not {dq.dtype} {tuple(dq.shape)}")
    if {tuple(lse.shape), tuple(delta.shape)} != {(B, H, Sq)}:
        raise ValueError(f"lse {tuple(lse.shape)} / delta {tuple(delta.shape)} must be "
                         f"{(B, H, Sq)}")
    check_rows(blocks, Sq, Sk)


# ------------------------------------------------------------------------------------------------
# the four entry points

def backward_delta(ops, dout, out):
    """delta[b, h, s] = sum_d dout[b, s, h, d] * out[b, s, h, d] in float32: (B,H,S)."""
    xp = ops.xp
    dtype = _kernel_dtype(dout)
    if out.shape != dout.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, dout {tuple(dout.shape)}")
    B, S, H, D = dout.shape
    delta = xp.empty((B, H, S), dtype=np.float32)
    rows = B * S * H
    if rows == 0:
        return delta
    out, dout = same_strides(xp, out, dout)
    if element_strides(dout)[-1] != 1:
        out, dout = xp.ascontiguousarray(out), xp.ascontiguousarray(dout)
    variant = delta_variant(dtype)
    grid = (cdiv(rows, variant.launch.block_m),)
    ops.function(variant.name)(grid, (variant.launch.threads,),
                               (bwd_delta_params(out, dout, delta),))
    return delta


def backward_init(ops, k, v, softmax_scale: float) -> BackwardContext:
    """Resident k, v (padded to the native head dim) and zeroed float32 dk, dv."""
    xp = ops.xp
    dtype = _kernel_dtype(k)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} differ")
    d = int(k.shape[-1])
    dp = ops.variant("bwd_dkdv", dtype, d).headdim
    kp, vp = same_strides(xp, ops.pad_headdim(k, dp), ops.pad_headdim(v, dp))
    kp, vp = same_strides(xp, vector_ready(xp, kp), vector_ready(xp, vp))
    shape = tuple(kp.shape)
    return BackwardContext(k=kp, v=vp, dk=xp.zeros(shape, dtype=np.float32),
                           dv=xp.zeros(shape, dtype=np.float32), scale=float(softmax_scale),
                           headdim=d, dtype=dtype)


def backward_step(ops, ctx: BackwardContext, q, dout, lse, delta, dq,
                  blocks: Sequence[Block], psum=None) -> None:
    """Add the gradients of the rectangles in `blocks` into ctx.dk, ctx.dv and into dq.

    q, dout: (B,Sq,H,D) visiting queries; lse, delta: (B,H,Sq) float32; dq: (B,Sq,H,D) float32,
    updated in place. GQA: query head h uses kv head h // (H // Hkv). psum: None, or (B,H,Sq)
    float32 to which each row's sum of the recomputed P over these blocks is added; it needs the
    deterministic kernels' dQ pass, so with psum they run whatever `ops.deterministic` says.
    """
    xp = ops.xp
    blocks = nonempty(blocks)
    if not blocks:
        return
    _check_step(ctx, q, dout, lse, delta, dq, blocks)
    B, Sq, H, D = q.shape
    Hkv = ctx.k.shape[2]
    dp = ctx.k.shape[-1]
    qp, dop = same_strides(xp, ops.pad_headdim(q, dp), ops.pad_headdim(dout, dp))
    qp, dop = same_strides(xp, vector_ready(xp, qp), vector_ready(xp, dop))
    lse, delta = same_strides(xp, rows_contiguous(xp, lse), rows_contiguous(xp, delta))
    dq_run = ops.pad_headdim(dq, dp)  # a padded copy when D < Dp: kernels write all Dp columns
    if element_strides(dq_run)[-1] != 1:
        dq_run = xp.ascontiguousarray(dq_run)
    psum_run = None
    if psum is not None:  # the dq kernel indexes psum with lse's strides: all three contiguous
        if tuple(psum.shape) != (B, H, Sq) or np.dtype(psum.dtype) != np.float32:
            raise ValueError(f"psum must be float32 {(B, H, Sq)}, not {psum.dtype} {tuple(psum.shape)}")
        lse, delta = xp.ascontiguousarray(lse), xp.ascontiguousarray(delta)
        psum_run = psum if psum.flags.c_contiguous else xp.zeros((B, H, Sq), dtype=np.float32)

    families, hopper = step_kernels(ops, ctx.dtype, ctx.headdim, blocks, qp.shape, ctx.scale,
                                    psum is not None)
    tiled = [tiled for _, tiled in families]
    hopper_list = hopper is not None and hopper.family.endswith(LIST_SUFFIX)
    listing = hopper_list or (hopper is None and len(blocks) > 1 and listable(blocks, tiled))
    lists = _step_lists(ops, ctx, blocks, families, hopper) if listing else None
    # at masked pairs P and dS are 0; the careful kernels keep a NaN/Inf in q, dout, k, v or
    # delta (or a dO . v that overflows) from making 0 x Inf = NaN there. A packed list masks
    # pairs by its rows' runs whatever the blocks say.
    masked = (any_masked(blocks) or (hopper_list and _ragged(blocks, hopper))
              or (lists is not None and any(groups.packed for groups in lists[:len(families)])))
    flag = ops.nonfinite_flag(qp, dop, ctx.k, ctx.v, delta) if masked else None
    operands = (qp, dop, ctx.k, ctx.v, lse, delta, dq_run, ctx.dk, ctx.dv, psum_run)
    if listing:
        _launch_list(ops, ctx, operands, blocks, families, lists, flag, masked, (H, Hkv, B), hopper)
    else:
        _launch_each(ops, ctx, operands, blocks, families, flag, (H, Hkv, B), hopper)
    if dq_run is not dq:
        dq[...] = ops.unpad_headdim(dq_run, D)
    if psum is not None and psum_run is not psum:
        psum += psum_run


def step_kernels(ops, dtype: str, headdim: int, blocks: Sequence[Block], q_shape: tuple, scale: float,
                 psum: bool = False) -> tuple[list[tuple[str, str]], Any]:
    """A backward step's kernel families, each with what its blocks of threads tile ("key" rows
    of k or "query" rows of q), and the Hopper dK/dV variant that takes the first family's place
    (`KernelOps.hopper_backward`; None: the mma.sync kernels run it). dQ has a pass of its own
    (flash_bwd_dq after the dK/dV kernel without dQ) in the deterministic mode and with psum;
    where `ops.dq_own_pass` prefers one (the sm_90a table at head dim 256) only if the Hopper
    kernel without dQ takes the step, since it was measured faster beside that kernel alone;
    else the dK/dV kernel adds dQ with fp32 atomics. q_shape: (B, Sq, H, Dp)."""
    own_pass, atomic = [("bwd_dkdv_nodq", "key"), ("bwd_dq", "query")], [("bwd_dkdv", "key")]
    families = own_pass if ops.deterministic or psum or ops.dq_own_pass(headdim) else atomic
    hopper = ops.hopper_backward(families[0][0], dtype, headdim, blocks, q_shape, scale,
                                 [tiled for _, tiled in families])
    if hopper is None and families is own_pass and not (ops.deterministic or psum):
        families = atomic   # the own pass paid off beside the Hopper kernel only
        hopper = ops.hopper_backward(families[0][0], dtype, headdim, blocks, q_shape, scale, ["key"])
    return families, hopper


def _launch_each(ops, ctx: BackwardContext, operands: tuple, blocks: Sequence[Block],
                 families: list, flag, heads: tuple, hopper=None) -> None:
    """`backward_step`'s launches a Block: each family's kernel over each Block in turn
    (operands: the step's arrays for `bwd_step_params`; heads: (H, Hkv, B)). `hopper`: the
    Hopper dK/dV variant (`KernelOps.hopper_backward`) that runs in place of the first family's
    kernel, paired where a Block has masked pairs with that family's mma.sync careful twin (the
    nonfinite flag runs exactly one of the two)."""
    H, Hkv, B = heads
    D = ctx.headdim
    for blk in blocks:  # one struct serves both kernels of a deterministic step
        params = bwd_step_params(*operands, ops.step_flag(blk.masked, flag), blk, ctx.scale)
        for i, (family, tiled) in enumerate(families):
            variant = ops.variant(family, ctx.dtype, D)
            rows = blk.k_len if tiled == "key" else blk.q_len
            grid = (cdiv(rows, _tile_rows(variant, tiled)), Hkv if tiled == "key" else H, B)
            if i > 0 or hopper is None:
                ops.launch_step(variant, grid, params, blk.masked)
                continue
            _launch_hopper(ops, hopper, operands, blk, ops.step_flag(blk.masked, flag), ctx.scale,
                           heads)
            if blk.masked:
                careful = ops.variant(family + CAREFUL_SUFFIX, ctx.dtype, D)
                ops.function(careful.name)(grid, (careful.launch.threads,), (params,),
                                           shared_mem=careful.launch.smem_bytes)


def _launch_hopper(ops, hopper, operands: tuple, blk: Block | None, flag, scale: float,
                   heads: tuple, groups=None) -> None:
    """One Block through flash_bwd_dkdv_sm90: tensor maps of the Block's q, dO, k and v rows,
    grid (ceil(k_len / block_n), Hkv, B) (block_n 128, 64 at head dim 256); or (blk None) a
    step's `groups` (`step_lists`, by key range, tiles of block_n keys) through
    flash_bwd_dkdv_steps_sm90: maps of the whole arrays, grid (groups.tiles, Hkv, B). It returns
    at once when `flag` is set."""
    H, Hkv, B = heads
    qp, dop, k, v, lse, delta, dq, dk, dv, _ = operands
    cfg = hopper.launch
    q_rows = (0, qp.shape[1]) if blk is None else (blk.q_start, blk.q_len)
    k_rows = (0, k.shape[1]) if blk is None else (blk.k_start, blk.k_len)
    dq_adds = _dq_adds(ops, hopper, dq)
    maps = (tensor_map_4d_rows(ops.backend, qp, *q_rows, cfg.block_m),
            tensor_map_4d_rows(ops.backend, dop, *q_rows, cfg.block_m),
            tensor_map_4d_rows(ops.backend, k, *k_rows, cfg.block_n),
            tensor_map_4d_rows(ops.backend, v, *k_rows, cfg.block_n),
            tensor_map_4d_rows(ops.backend, dq, *q_rows, SM90_DQ_BOX[0], SM90_DQ_BOX[1])
            if dq_adds == 3 else None)
    params = bwd_step_sm90_params(maps, lse, delta, dq, dk, dv, flag, blk, H, Hkv, scale, groups,
                                  dq_adds)
    grid = (groups.tiles if blk is None else cdiv(blk.k_len, cfg.block_n), Hkv, B)
    ops.function(hopper.name)(grid, (cfg.threads,), (params,), shared_mem=cfg.smem_bytes)


DQ_ADDS_NAMES = {1: "singles", 2: "pairs", 3: "bulk"}   # BwdStepSm90Params.dq_adds


def dq_adds_of(ops, hopper, aligned: bool) -> int:
    """How the Hopper kernel `hopper` adds dQ (BwdStepSm90Params.dq_adds) into a dq whose rows
    sit on 16 bytes at non-negative strides (`aligned`; what the bulk family's tensor map needs):
    by bulk tensor reductions (3) in the bulk family, or two floats an atomic add (2) where
    `ops.sm90_dq_adds` is "pairs" and the head dim at most 128 (the kernel's kDqPairs); else,
    and for any dq not so, one float an add (1)."""
    if not aligned:
        return 1
    if hopper.family.startswith(SM90_DKDV_BULK):
        return 3
    return 2 if ops.sm90_dq_adds == "pairs" and hopper.headdim <= 128 else 1


def _dq_adds(ops, hopper, dq) -> int:
    """dq_adds_of for the array `dq`."""
    return dq_adds_of(ops, hopper, rows_on_16_bytes(dq) and min(dq.strides) >= 0)


def _ragged(blocks: Sequence[Block], hopper) -> bool:
    """Whether a Block's rows end inside a tile of the Hopper list kernel `hopper`: its maps cover
    the whole arrays, so such a tile reads the next rows (P = 0 there, but 0 x Inf = NaN), and
    the step takes the careful pair as one with masked pairs does."""
    return bool(np.any(block_column(blocks, "q_len") % hopper.launch.block_m)
                or np.any(block_column(blocks, "k_len") % hopper.launch.block_n))


def _step_lists(ops, ctx: BackwardContext, blocks: Sequence[Block], families: list,
                hopper=None) -> tuple:
    """The StepGroups of a list step (`ops.step_lists`, kept with the context until the step
    has run): one a family, by its range in its kernel's tiles (the first family's: `hopper`'s
    where the Hopper list kernel takes its place), then, with `hopper`, the first family's own
    key tiles for its mma.sync careful twin."""
    listed = [ops.variant(family + LIST_SUFFIX, ctx.dtype, ctx.headdim) for family, _ in families]
    runs = [hopper or listed[0], *listed[1:]]
    groupings = [(tiled, _tile_rows(variant, tiled)) for variant, (_, tiled) in zip(runs, families)]
    if hopper is not None:
        groupings.append(("key", _tile_rows(listed[0], "key")))
    lists = ops.step_lists(blocks, groupings)
    ctx.keep.append(lists)
    return lists


def _launch_list(ops, ctx: BackwardContext, operands: tuple, blocks: Sequence[Block],
                 families: list, lists: tuple, flag, masked: bool, heads: tuple,
                 hopper=None) -> None:
    """`backward_step`'s launches for a whole step: each family's list kernel once over its
    `lists` entry (`_step_lists`; arguments as in `_launch_each`; masked: whether the step's
    careful pairs run, `flag` set where it is). `hopper`: the Hopper list kernel
    (flash_bwd_dkdv_steps_sm90) in place of the first family's, with tensor maps of the whole
    arrays, paired where `masked` (masked pairs, rows ending inside its tiles, or a packed list)
    with that family's mma.sync careful list twin on the last entry of `lists`; the other
    families pair where pairs are masked (in the blocks, or by a packed list's runs)."""
    H, Hkv, B = heads
    pairs_masked = any_masked(blocks)
    for i, ((family, tiled), groups) in enumerate(zip(families, lists)):
        grid = (groups.tiles, Hkv if tiled == "key" else H, B)
        if i == 0 and hopper is not None:
            _launch_hopper(ops, hopper, operands, None, ops.step_flag(masked, flag), ctx.scale,
                           heads, groups)
            if masked:   # the mma.sync careful list twin on its own tiles: the flag runs one
                careful = ops.variant(family + LIST_SUFFIX + CAREFUL_SUFFIX, ctx.dtype,
                                      ctx.headdim)
                twin = lists[-1]
                params = bwd_step_params(*operands, flag, None, ctx.scale, twin)
                ops.function(careful.name)((twin.tiles, Hkv, B), (careful.launch.threads,),
                                           (params,), shared_mem=careful.launch.smem_bytes)
            continue
        variant = ops.variant(family + LIST_SUFFIX, ctx.dtype, ctx.headdim)
        these_masked = pairs_masked or groups.packed
        params = bwd_step_params(*operands, ops.step_flag(these_masked, flag), None, ctx.scale,
                                 groups)
        ops.launch_step(variant, grid, params, these_masked)


def backward_finalize(ops, ctx: BackwardContext, out_dtype) -> tuple[Any, Any]:
    """(dk, dv): (B,Sk,Hkv,D) in out_dtype (the padding columns dropped)."""
    dk = ops.unpad_headdim(ctx.dk, ctx.headdim).astype(out_dtype)
    dv = ops.unpad_headdim(ctx.dv, ctx.headdim).astype(out_dtype)
    return dk, dv
