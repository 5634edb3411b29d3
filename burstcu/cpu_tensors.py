"""CPU torch tensors as NumPy views of their values, and NumPy arrays as CPU tensors, bfloat16
included (through int16: NumPy cannot import bfloat16 over DLPack); torch tensors' lazy
negation and conjugation applied, which DLPack does not carry. Imports neither torch nor
anything of burstcu: torch is used only where the caller has imported it."""

from __future__ import annotations

import sys

import numpy as np


def resolved(x, detach: bool = False):
    """A torch tensor with its lazy negation and conjugation applied (a view such as
    z.conj().imag holds -values it reads from memory that holds values: DLPack hands over the
    memory alone), detached with `detach`; anything else as it is."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return x
    return (x.detach() if detach else x).resolve_conj().resolve_neg()


def host_view(x):
    """A CPU torch tensor as a NumPy view of its values (`resolved`, detached; bfloat16 through
    int16, viewed back as ml_dtypes.bfloat16: NumPy cannot import bfloat16 over DLPack, nor take
    a tensor that requires grad); anything else as it is."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return x
    x = resolved(x, detach=True).contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def tensor_of(x: np.ndarray):
    """A NumPy array as a CPU torch tensor of its dtype, zero-copy where it is contiguous
    (bfloat16 through int16, as `host_view` takes it)."""
    import torch
    x = np.ascontiguousarray(x)
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)
