"""Launcher of the decode kernels (kernels/flash_decode.cu) on the kernel backends (CuPy, or the
CPU emulator): this rank's partial attention of the new tokens over its valid cache rows, in
the format of `burstcu.ops.decode.partial` (acc (B,T,H,D), m (B,H,T) natural log, l (B,H,T),
float32), so the ranks' partials merge alike.

Splits: each batch row's keys are cut into `splits` chunks of `chunk` rows (chunk a multiple of
the block's warps), enough blocks to fill the device (TARGET_BLOCKS) but at least MIN_CHUNK keys
a block; the split kernel writes every split's (m, l, acc) to a workspace that the combine kernel
reduces.
"""

from __future__ import annotations

import numpy as np

from ...build.decode_variants import NWARPS
from .params import CStruct, element_strides

DECODE_SPLIT = CStruct("DecodeSplitParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("lengths", "ptr"), ("ws_m", "ptr"),
    ("ws_l", "ptr"), ("ws_acc", "ptr"), ("q_sb", "i64"), ("q_st", "i64"), ("q_sh", "i64"),
    ("k_sb", "i64"), ("k_ss", "i64"), ("k_sh", "i64"), ("T_", "i32"), ("H", "i32"),
    ("Hkv", "i32"), ("D", "i32"), ("chunk", "i32"), ("splits", "i32"), ("scale_log2", "f32")],
    templated=True)
DECODE_COMBINE = CStruct("DecodeCombineParams", [
    ("ws_m", "ptr"), ("ws_l", "ptr"), ("ws_acc", "ptr"), ("acc", "ptr"), ("m", "ptr"),
    ("l", "ptr"), ("T_", "i32"), ("H", "i32"), ("D", "i32"), ("splits", "i32")])
DECODE_STRUCTS = (DECODE_SPLIT, DECODE_COMBINE)

TARGET_BLOCKS = 512   # split blocks a launch aims at (a few waves on a large GPU)
MIN_CHUNK = 64        # keys a split reads at least
KERNEL_DTYPES = ("float16", "bfloat16", "float32")


def splits_for(longest: int, blocks_per_split: int) -> tuple[int, int]:
    """(chunk, splits) for a longest batch row of `longest` valid keys when each split makes
    `blocks_per_split` blocks (Hkv x row groups x B)."""
    want = max(1, TARGET_BLOCKS // max(1, blocks_per_split))
    chunk = max(MIN_CHUNK, -(-max(longest, 1) // want))
    chunk = -(-chunk // NWARPS) * NWARPS
    return chunk, max(1, -(-longest // chunk))


def partial(ops, q, k_cache, v_cache, lengths, scale: float):
    """(acc, m, l) of this rank's valid cache rows (module docstring); q (B,T,H,D), k_cache,
    v_cache (B,S,Hkv,D) of one dtype in KERNEL_DTYPES with contiguous last dims; lengths: host
    ints (B,)."""
    xp = ops.xp
    b, t, h, d = q.shape
    hkv = k_cache.shape[2]
    dtype = np.dtype(q.dtype).name
    if element_strides(q)[-1] != 1:
        q = xp.ascontiguousarray(q)
    if element_strides(k_cache)[-1] != 1 or element_strides(k_cache) != element_strides(v_cache):
        k_cache, v_cache = xp.ascontiguousarray(k_cache), xp.ascontiguousarray(v_cache)
    split = ops.variant("decode", dtype, d)
    rows = split.launch.block_m
    groups = -(-(h // hkv * t) // rows)
    chunk, splits = splits_for(int(np.max(lengths)) if len(lengths) else 0, hkv * groups * b)
    ws_m = xp.empty((b, h, t, splits), np.float32)
    ws_l = xp.empty((b, h, t, splits), np.float32)
    ws_acc = xp.empty((b, h, t, splits, d), np.float32)
    lengths_dev = xp.asarray(np.asarray(lengths, np.int32))
    qs, ks = element_strides(q), element_strides(k_cache)
    params = DECODE_SPLIT.pack(
        q=q, k=k_cache, v=v_cache, lengths=lengths_dev, ws_m=ws_m, ws_l=ws_l, ws_acc=ws_acc,
        q_sb=qs[0], q_st=qs[1], q_sh=qs[2], k_sb=ks[0], k_ss=ks[1], k_sh=ks[2], T_=t, H=h,
        Hkv=hkv, D=d, chunk=chunk, splits=splits, scale_log2=float(scale) * float(np.log2(np.e)))
    ops.function(split.name)((splits, hkv * groups, b), (split.launch.threads,), (params,))
    acc = xp.empty((b, t, h, d), np.float32)
    m = xp.empty((b, h, t), np.float32)
    l = xp.empty((b, h, t), np.float32)
    combine = ops.variant("decode_combine", "float32", d)
    ops.function(combine.name)((t * h, b), (combine.launch.threads,),
                               (DECODE_COMBINE.pack(ws_m=ws_m, ws_l=ws_l, ws_acc=ws_acc, acc=acc,
                                                    m=m, l=l, T_=t, H=h, D=d, splits=splits),))
    return acc, m, l
