"""A device `LocalOps` seen through NumPy arrays.

Kernel checks are written once, with NumPy inputs and float64 references on the host.
`HostArrays(KernelOps("cupy"))` copies each NumPy argument to the device, runs the wrapped op,
and copies results back, so the same check runs on a GPU; around a NumPy op (the emulator) it
changes nothing. Running states (forward state, backward context) stay on the device.
`dq` of `backward_step` is updated in place on the host, as the op updates it on the device.
Everything else (`variant`, `function`, `deterministic`, ...) is the wrapped op's.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class HostArrays:
    """`ops` with NumPy arrays in and out (see the module docstring)."""

    def __init__(self, ops: Any):
        self.ops = ops

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def to_device(self, x):
        """x on the op's device (x itself when it is already there or the op is NumPy)."""
        if isinstance(x, np.ndarray) and self.ops.xp is not np:
            return self.ops.xp.asarray(x)
        return x

    def host(self, x):
        """x as a NumPy array (device arrays are copied back; the copy synchronizes)."""
        return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale: float | None = None):
        return self.ops.forward_init(self.to_device(q), softmax_scale)

    def forward_step(self, state, k, v, blocks: Sequence, last: bool = False) -> None:
        self.ops.forward_step(state, self.to_device(k), self.to_device(v), blocks, last)

    def forward_finalize(self, state, out_dtype) -> tuple:
        return tuple(self.host(x) for x in self.ops.forward_finalize(state, out_dtype))

    # -- backward ----------------------------------------------------------------------------------
    def backward_delta(self, dout, out):
        return self.host(self.ops.backward_delta(self.to_device(dout), self.to_device(out)))

    def backward_init(self, k, v, softmax_scale: float):
        return self.ops.backward_init(self.to_device(k), self.to_device(v), softmax_scale)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks: Sequence, psum=None) -> None:
        dq_device = self.to_device(dq)
        psum_device = None if psum is None else self.to_device(psum)
        self.ops.backward_step(ctx, *(self.to_device(x) for x in (q, dout, lse, delta)), dq_device,
                               blocks, psum_device)
        if dq_device is not dq:
            dq[...] = self.host(dq_device)
        if psum_device is not None and psum_device is not psum:
            psum[...] = self.host(psum_device)

    def backward_finalize(self, ctx, out_dtype) -> tuple:
        return tuple(self.host(x) for x in self.ops.backward_finalize(ctx, out_dtype))
