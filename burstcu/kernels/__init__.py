"""CUDA kernel sources, their variants, and the two ways to build them (NVRTC here, the CPU
emulator in `burstcu.testing.emulate`). `all_variants(arch)`: every instantiation the library can
launch with the tile table `arch`, forward and backward families."""

from .bwd_variants import backward_variants
from .fwd_variants import forward_variants
from .variants import ARCHS, KernelVariant


def all_variants(arch: str) -> list[KernelVariant]:
    """Every variant the library can launch on `arch` (forward and backward families)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    return forward_variants(arch) + backward_variants(arch)


__all__ = ["all_variants"]
