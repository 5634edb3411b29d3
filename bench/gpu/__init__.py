"""Benchmarks and checks that need one CUDA GPU (each has a --dry-run or a CPU path)."""
