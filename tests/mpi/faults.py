"""Programs that fail on purpose, run as users run them: `mpiexec -n N python -m mpi4py
tests/mpi/faults.py SCENARIO [TIMEOUT]` (an uncaught exception then aborts the world, as mpi4py's
`-m mpi4py` does). tests/test_failures.py checks that each ends the job quickly, non-zero, with a
message naming the failing or missing rank. Rank 1 is the one that misbehaves.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import numpy as np  # noqa: E402

import burstcu  # noqa: E402


def _inputs(group, n=64, h=2, d=16):
    rng = np.random.default_rng(group.rank)
    return [rng.standard_normal((1, n // group.size, h, d)) for _ in range(4)]


def _fail_at_step(group, step: int, action):
    """Make this rank's forward_step run `action` at its `step`-th call."""
    inner, calls = group.ops.forward_step, [0]

    def forward_step(*args):
        calls[0] += 1
        if calls[0] == step:
            action()
        return inner(*args)

    group.ops.forward_step = forward_step


def main(scenario: str, timeout: float) -> None:
    if scenario == "exit_before_init":
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            sys.exit(0)
    group = burstcu.init(backend="numpy", timeout=timeout)
    q, k, v, dout = _inputs(group)
    bad = group.rank == 1
    if scenario == "raise_before_call" and bad:
        raise RuntimeError("user code failed on rank 1 before calling burstcu")
    if scenario == "exit_early" and bad:
        sys.exit(0)
    if scenario == "sleep_past_timeout" and bad:
        time.sleep(10 * timeout)
    if scenario == "raise_in_step" and bad:
        _fail_at_step(group, 2, lambda: (_ for _ in ()).throw(MemoryError("simulated: out of memory")))
    if scenario == "interrupt_in_agreement" and bad:  # Ctrl-C while the inputs are checked
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt()
        sys.modules["burstcu.api"].check_attention_inputs = interrupted
    if scenario == "barrier_late":
        if bad:
            time.sleep(10 * timeout)
        group.barrier()
    if scenario == "sigkill_mid_ring" and bad:
        _fail_at_step(group, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if scenario == "mismatched_calls":
        try:
            if bad:
                group.barrier()
            else:
                burstcu.attention(q, k, v, group)
        except ValueError as exc:
            sys.stdout.write(f"rank {group.rank} caught: {exc}\n")
            sys.stdout.flush()
            group.close()
            return
    if scenario == "slow_peer_cpu":  # rank 1 arrives 3 s late; the others must not spin
        if bad:
            time.sleep(3)
        t0, c0 = time.monotonic(), time.process_time()
        burstcu.attention(q, k, v, group, causal=True)
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
        sys.stdout.write(f"rank {group.rank} waited {wall:.2f} s using {cpu:.3f} s of CPU\n")
        sys.stdout.flush()
        group.close()
        return
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
    sys.stdout.write(f"rank {group.rank} finished\n")
    sys.stdout.flush()
    group.close()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
