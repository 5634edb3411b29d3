"""Verification-only code, like `numpy.testing`: nothing in the library's run path imports it.

* `reference`: float64 attention written plainly (full score matrix, explicit softmax) and the
  FlashAttention tolerance rule;
* `host_arrays`: a device LocalOps seen through NumPy arrays, so one test body checks the CUDA
  kernels under the CPU emulator and on a GPU.
"""
