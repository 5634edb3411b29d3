"""Argument helpers shared by the CUDA kernels' launchers (`kernel_ops`, `kernel_bwd`): the
kernels take NumPy scalars of exact widths and element strides, and read 16-byte vectors.

Arrays are CuPy (a GPU) or NumPy (the emulator); every helper works on both.
"""

from __future__ import annotations

import numpy as np

from ..layout import Block

I32_MAX = 2**31 - 1
# "no bound" for the kernels' key bounds: large enough for any sequence, small enough that a
# position (below 2^30) plus it stays within int32
NO_BOUND = 1 << 29
MAX_POSITION = 1 << 30


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def i32(*values) -> list:
    return [np.int32(v) for v in values]


def i64(*values) -> list:
    return [np.int64(v) for v in values]


def data_ptr(x) -> int:
    """The address of x's first element (CuPy or NumPy)."""
    iface = getattr(x, "__cuda_array_interface__", None) or x.__array_interface__
    return int(iface["data"][0])


def element_strides(x, int32: bool = False) -> tuple[int, ...]:
    """Strides in elements; with int32, ValueError if one does not fit a 32-bit argument."""
    strides = tuple(s // x.itemsize for s in x.strides)
    if int32 and any(abs(s) > I32_MAX for s in strides):
        raise ValueError(f"tensor of shape {tuple(x.shape)} has strides {strides} beyond int32")
    return strides


def vector_ready(xp, x):
    """x itself if cp.async can read it (16-byte aligned base, last dim contiguous, other strides
    non-negative multiples of 8 elements), else an aligned contiguous copy."""
    es = element_strides(x)
    ok = data_ptr(x) % 16 == 0 and es[-1] == 1 and all(s % 8 == 0 and s >= 0 for s in es[:-1])
    return x if ok else xp.array(x, order="C", copy=True)


def same_strides(xp, a, b):
    """(a, b) with identical element strides (the kernels take one stride triple for both).
    A copy made here is a fresh, hence aligned, allocation."""
    if a.strides == b.strides:
        return a, b
    return xp.ascontiguousarray(a), xp.ascontiguousarray(b)


def rows_contiguous(xp, x):
    """A (B, H, S) float32 row statistic with contiguous rows."""
    x = xp.asarray(x, dtype=np.float32)
    return x if element_strides(x)[-1] == 1 else xp.ascontiguousarray(x)


def key_bounds(block: Block) -> list:
    """The kernels' (hi, lo) of a block as np.int32: element (i, j) is kept iff
    q_pos + i - lo <= k_pos + j <= q_pos + i + hi (causal: hi = 0; a window cutting through the
    block: its right / left edge; no bound: NO_BOUND)."""
    hi = NO_BOUND
    if block.causal:
        hi = 0
    if block.right >= 0:
        hi = min(hi, block.right)
    lo = block.left if block.left >= 0 else NO_BOUND
    if max(block.q_pos + block.q_len, block.k_pos + block.k_len) > MAX_POSITION:
        raise ValueError(f"global positions up to {MAX_POSITION} only (the kernels add bounds of "
                         f"up to 2^29 to them in int32); this block reaches "
                         f"{max(block.q_pos + block.q_len, block.k_pos + block.k_len)}")
    return i32(hi, lo)
