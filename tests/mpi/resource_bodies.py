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


def init_close_cycles(cycles: int = 4500) -> dict:
    """`cycles` of init/close (each duplicates and frees a communicator): none may leak (MPICH
    runs out of communicator ids after ~2047 leaked ones: 4,500 cycles leaking one in two would
    fail), and close twice is harmless."""
    for _ in range(cycles):
        group = burstcu.init(backend="numpy")
        group.close()
    group.close()  # idempotent
    with burstcu.init(backend="numpy") as group:  # still usable afterwards
        q = np.ones((1, 8, 1, 8))
        out = burstcu.attention(q, q, q, group)
        assert np.allclose(out, 1.0)
    return {"cycles": cycles}


def closed_groups_leave_no_message(cycles: int = 40) -> dict:
    """Groups closed at different moments on each rank (rank r lingers after cycle c where
    c % G == r): the notice each close sends its peers (`Transport.say_left`) never reaches a
    communicator made later, neither the next group's calls nor the user's own duplicate of the
    world (MPICH hands a freed communicator's context to the next one made), and the
    communicators kept until their peers' notices come back stay few."""
    import time

    from mpi4py import MPI

    from burstcu.transport.mpi import PARKED

    world, q = MPI.COMM_WORLD, np.ones((1, 8, 1, 8))
    stray = parked = 0
    for cycle in range(cycles):
        with burstcu.init(backend="numpy", timeout=60) as group:
            assert np.allclose(burstcu.attention(q, q, q, group), 1.0)
        if cycle % world.size == world.rank:
            time.sleep(0.02)
        users = world.Dup()
        time.sleep(0.005)
        stray += bool(users.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG))
        users.Free()
        parked = max(parked, len(PARKED.comms))
    return {"stray": stray, "parked": parked}


# (batch, rows per rank, heads, kv heads, dim, dtype): arrays of 16 MiB a rank (the first, as a
# training step at batch 64 has), and smaller ones between; the sizes add up past any amount of
# work arrays an op might keep between calls
TRAINING_SHAPES = [(64, 64, 8, 8, 128, "float32"), (4, 96, 4, 2, 32, "float64"),
                   (32, 64, 8, 4, 128, "float32"), (1, 512, 8, 8, 64, "float32"),
                   (64, 32, 8, 2, 64, "float64")]


def _training_step(group, q, k, v, dout) -> list[np.ndarray]:
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    return [out, lse, *burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)]


def _sharded_inputs(group, shape, seed) -> tuple[list, list]:
    """(global q, k, v, dout; this rank's contiguous shards of them)."""
    from .bodies import make_inputs

    b, rows, h, hkv, d, dtype = shape
    full = make_inputs(seed, b, rows * group.size, h, hkv, d, dtype)
    mine = slice(group.rank * rows, (group.rank + 1) * rows)
    return full, [np.ascontiguousarray(x[:, mine]) for x in full]


def _check_against_float64(group, shape, full, got) -> None:
    """`got` (out, lse, dq, dk, dv) on this rank's rows against the float64 reference, by
    FlashAttention's rule (against a naive implementation in the inputs' dtype)."""
    from .bodies import EPS
    from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule

    dtype, rows = shape[-1], shape[1]
    mine = slice(group.rank * rows, (group.rank + 1) * rows)
    q, k, v, dout = full
    naive_t = np.float64 if dtype == "float64" else np.float32
    truth_t = np.longdouble if dtype == "float64" else np.float64
    ref, naive = ([attention_ref(q, k, v, causal=True, dtype=t)[0],
                   *attention_backward_ref(dout, q, k, v, causal=True, dtype=t)]
                  for t in (truth_t, naive_t))
    for name, x, r, n in zip(("out", "dq", "dk", "dv"), [got[0], *got[2:]], ref, naive):
        ok, err, bound = within_fa_rule(x, r[:, mine], n[:, mine], EPS[dtype])
        assert ok, f"rank {group.rank} {shape} {name}: error {err:.3g} > {bound:.3g}"


def training_loop(steps: int = 3, rounds: int = 2) -> dict:
    """A training loop: `steps` forward+backward steps at the largest shape, then `rounds`
    passes over every shape in a shuffled order (the same on every rank). Each shape's first
    call meets the float64 reference; every later call gives its bits: nothing one call leaves
    behind changes, or breaks, a later one."""
    with burstcu.init(backend="numpy") as group:
        inputs = [_sharded_inputs(group, shape, seed) for seed, shape in enumerate(TRAINING_SHAPES)]
        first: dict[int, list] = {}

        def call(i: int) -> None:
            full, mine = inputs[i]
            got = _training_step(group, *mine)
            if i not in first:
                _check_against_float64(group, TRAINING_SHAPES[i], full, got)
                first[i] = got
            assert all(np.array_equal(a, b) for a, b in zip(got, first[i])), TRAINING_SHAPES[i]

        for _ in range(steps):
            call(0)
        order = np.random.default_rng(1)
        for _ in range(rounds):
            for i in order.permutation(len(TRAINING_SHAPES)):
                call(int(i))
        return {"calls": steps + rounds * len(TRAINING_SHAPES)}
