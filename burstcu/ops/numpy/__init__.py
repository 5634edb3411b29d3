"""The NumPy local op: the reference and portability path (any CPU, float16 to float64).

tiled.py  NumpyOps: the forward and backward steps as tiles folded with BLAS matmuls, its thread
          pool, and `blas_advice` (what to install when the BLAS is slow)
"""

from .tiled import NumpyOps, blas_advice

__all__ = ["NumpyOps", "blas_advice"]
