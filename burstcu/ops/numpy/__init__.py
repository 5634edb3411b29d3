"""The NumPy local op: the reference and portability path (any CPU, float16 to float64).

op.py       NumpyOps: the forward and backward steps, their state and work items
tiles.py    layouts, tile cutting, and the fold paths of one tile (lazy, rescaled, exact, masked)
threads.py  the work pool (BLAS held to one thread), turns that keep results thread-count
            independent, `blas_advice`
How fast and why: docs/numpy-op.md.
"""

from .op import NumpyOps
from .threads import blas_advice

__all__ = ["NumpyOps", "blas_advice"]
