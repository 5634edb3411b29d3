"""CUDA kernel sources, their variants, and the two ways to build them (NVRTC here, the CPU
emulator in `burstcu.build.emulate`). `all_variants(arch)`: every instantiation the library can
launch with the tile table `arch`, forward, backward and decode families. `BuildTimeoutError`:
a build waited past $BURSTCU_BUILD_TIMEOUT (see `burstcu.build.compile`)."""

from .bwd_variants import backward_variants
from .compile import BuildTimeoutError
from .decode_variants import decode_variants
from .fwd_variants import forward_variants
from .variants import ARCHS, KernelVariant


def all_variants(arch: str) -> list[KernelVariant]:
    """Every variant the library can launch on `arch` (forward, backward and decode families)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    return forward_variants(arch) + backward_variants(arch) + decode_variants(arch)


__all__ = ["BuildTimeoutError", "all_variants"]
