"""CUDA kernel sources, their variants, and the two ways to build them (NVRTC, CPU emulator)."""
