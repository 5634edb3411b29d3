"""Benchmarks of burstcu: cpu/ (CPU + MPI runs of the schedules), gpu/ (one CUDA GPU), model/
(PREDICTIONS of the library's cost model, and its pick checked against measurements)."""
