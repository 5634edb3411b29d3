"""Bodies for tests/test_failures.py's resource checks, run on every rank under mpiexec."""

from __future__ import annotations

import os

import numpy as np

import burstcu


def _rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(calls: int = 1000, warmup: int = 100) -> dict:
    """`calls` forward+backward calls after `warmup`: resident memory must stay flat."""
    with burstcu.init(backend="numpy") as group:
        rng = np.random.default_rng(group.rank)
        q, k, v, dout = (rng.standard_normal((1, 32, 2, 16)) for _ in range(4))

        def call():
            out, lse = burstcu.attention(q, k, v, group, causal=True, layout="zigzag", return_lse=True)
            burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True, layout="zigzag")

        for _ in range(warmup):
            call()
        before = _rss_bytes()
        for _ in range(calls):
            call()
        after = _rss_bytes()
    growth = (after - before) / before
    assert growth < 0.02, f"RSS grew {100 * growth:.1f}% over {calls} calls ({before} -> {after} B)"
    return {"before": before, "after": after}


def init_close_cycles(cycles: int = 10000) -> dict:
    """`cycles` of init/close (each duplicates and frees a communicator): none may leak (MPICH
    runs out of communicator ids after ~2047 leaked ones), and close twice is harmless."""
    for _ in range(cycles):
        group = burstcu.init(backend="numpy")
        group.close()
    group.close()  # idempotent
    with burstcu.init(backend="numpy") as group:  # still usable afterwards
        q = np.ones((1, 8, 1, 8))
        out = burstcu.attention(q, q, q, group)
        assert np.allclose(out, 1.0)
    return {"cycles": cycles}
