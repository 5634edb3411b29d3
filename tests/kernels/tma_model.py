"""What a bulk tensor copy (TMA) reads, for the tests' models of it: a box of a tensor at given
coordinates, zeros outside the tensor (the driver's OOB fill NONE). Written from the CUDA driver
API's description of tiled tensor maps, independently of the emulator (kernels/emu/emu_hopper.h)."""

from __future__ import annotations

import numpy as np


def box_values(L: np.ndarray, box, coords) -> np.ndarray:
    """The box of L (indexed L[i0, i1, ...], dim 0 innermost) at `coords` (signed), zeros outside
    L, as a row-major array of shape box[::-1] (dim 0 innermost)."""
    grids = np.meshgrid(*[np.arange(b) + c for b, c in zip(box, coords)], indexing="ij")
    inside = np.ones(grids[0].shape, bool)
    for g, n in zip(grids, L.shape):
        inside &= (g >= 0) & (g < n)
    vals = np.zeros(tuple(box), L.dtype)
    vals[inside] = L[tuple(g[inside] for g in grids)]
    return vals.transpose(tuple(range(len(box) - 1, -1, -1)))
