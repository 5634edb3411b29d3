"""Benchmarks that run on CPU ranks under mpiexec (several also take --backend cupy)."""
