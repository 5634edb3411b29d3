"""Programs that fail on purpose, run as users run them: `mpiexec -n N python -m mpi4py
tests/mpi/faults.py SCENARIO [TIMEOUT]` (an uncaught exception then aborts the world, as mpi4py's
`-m mpi4py` does), or as a plain `python tests/mpi/faults.py ...`. tests/test_failures.py checks
that each ends the job quickly, non-zero, with a message naming the failing or missing rank.
Rank 1 is the one that misbehaves.
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


# what rank 1 changes of burstcu.init's arguments (and environment) when the others pass
# (backend="numpy", timeout=TIMEOUT): each case is refused on every rank, naming rank 1
BAD_INIT = {"bad_timeout": ({}, {"timeout": 0}),
            "bad_env_timeout": ({"BURSTCU_TIMEOUT": "soon"}, {"timeout": None}),
            "bad_link": ({}, {"link": "1 Gb/s"}),
            "bad_progress": ({}, {"progress": "eager"}),
            "other_timeout": ({}, {"timeout": "twice"}),
            "bad_env_build_timeout": ({"BURSTCU_BUILD_TIMEOUT": "-1"}, {"backend": "emulated"}),
            "bad_option": ({}, {"tile_q": -1}),
            "other_option": ({}, {"tile_q": 32}),   # tile sizes change the bits
            "huge_timeout": ({}, {"timeout": 10**400})}


def _launched_rank() -> int:
    """This rank, from the launcher's environment (before MPI is initialised)."""
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def _init(case: str | None, timeout: float, link=None):
    """burstcu.init as this rank makes it in `case` (None: as the good ranks do), with `link`."""
    env, changed = BAD_INIT[case] if case and _launched_rank() == 1 else ({}, {})
    kwargs = dict(backend="numpy", timeout=timeout, link=link)
    kwargs.update({k: 2 * timeout if v == "twice" else v for k, v in changed.items()})
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return burstcu.init(**kwargs)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def init_errors_caught(timeout: float) -> None:
    """Every BAD_INIT case in turn, caught: each rank prints what it raised."""
    for case in BAD_INIT:
        try:
            _init(case, timeout).close()
        except (ValueError, TypeError) as exc:
            sys.stdout.write(f"rank {_launched_rank()} {case}: {type(exc).__name__}: {exc}\n")
        else:
            sys.stdout.write(f"rank {_launched_rank()} {case}: no error\n")
        sys.stdout.flush()


HANGING_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "hanging-c++ 1.0"; exit 0; fi
exec sleep 120
"""


def build_hangs(timeout: float) -> None:
    """The emulated backend, rank 1's compiler hanging (in a kernel cache of its own, so it
    must build): past $BURSTCU_BUILD_TIMEOUT (2 s) its build raises and the job ends."""
    import tempfile

    from burstcu.build import emulate

    if _launched_rank() == 1:
        private = tempfile.mkdtemp(prefix="burstcu-hanging-build-")
        compiler = os.path.join(private, "c++")
        with open(compiler, "w") as fh:
            fh.write(HANGING_CXX)
        os.chmod(compiler, 0o755)
        os.environ.update(BURSTCU_CACHE_DIR=os.path.join(private, "cache"), BURSTCU_BUILD_TIMEOUT="2")
        emulate._CXX = compiler
    group = burstcu.init(backend="emulated", timeout=10 * timeout)
    rng = np.random.default_rng(group.rank)
    q = rng.standard_normal((1, 64, 2, 64)).astype(np.float16)
    burstcu.attention(q, q, q, group)
    _say(f"rank {group.rank} finished")


def before_init(scenario: str) -> None:
    """What rank 1 does before burstcu.init in the scenarios about that time."""
    if scenario == "exit_before_init":
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() == 1:
            sys.exit(0)
    if scenario == "os_exit_before_init" and _launched_rank() == 1:
        os._exit(0)
    if scenario == "raise_before_init" and _launched_rank() == 1:
        raise RuntimeError("user code failed on rank 1 before burstcu.init")


def misbehave(scenario: str, group, timeout: float, q, k, v) -> None:
    """What rank 1 (or every rank) does wrong once the group exists."""
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
        sys.modules["burstcu.api"].check_attention_call = interrupted
    if scenario == "barrier_late":
        if bad:
            time.sleep(10 * timeout)
        group.barrier()
    if scenario == "sigkill_mid_ring" and bad:
        _fail_at_step(group, 2, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if scenario == "os_exit_between_calls":
        burstcu.attention(q, k, v, group)
        if bad:
            os._exit(0)
    if scenario == "interrupt_between_calls":   # Ctrl-C reaches rank 1 outside any call
        burstcu.attention(q, k, v, group)
        if bad:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10 * timeout)
    if scenario == "bad_append_uncaught":   # rank 1 alone appends rows of another shape
        cache = burstcu.KVCache(group, batch=1, capacity_per_rank=8, kv_heads=2, headdim=64,
                                dtype=np.float32)
        cache.append(*[np.zeros((1, 1, 2, 32 if bad else 64), np.float32)] * 2)
        cache.decode(np.zeros((1, 1, 2, 64), np.float32))
    if scenario == "bad_input_uncaught":   # every rank raises the same error, which no one catches
        burstcu.attention(q[0], k, v, group)
    if scenario == "wait_forever" and bad:   # the others wait for it with no deadline
        time.sleep(1.0)


def mismatched_calls(group, q, k, v) -> None:
    try:
        if group.rank == 1:
            group.barrier()
        else:
            burstcu.attention(q, k, v, group)
    except ValueError as exc:
        _say(f"rank {group.rank} caught: {exc}")


def one_more_call(leaving: int, closes: bool):
    """An ending where rank `leaving` leaves the group (closing it, or its program ending with
    it open) and the others make one more call (an evaluation it does not make): they must fail
    at once, not at the timeout, and so must a second such call after the first's error was
    caught. True: the rank leaves its group as it is (else main closes it)."""
    def ending(group, q, k, v) -> bool:
        if group.rank == leaving:
            if closes:
                group.close()
            return True
        for attempt in (1, 2):
            t0 = time.monotonic()
            try:
                burstcu.attention(q, k, v, group)
            except ValueError as exc:
                _say(f"rank {group.rank} caught call {attempt} after {time.monotonic() - t0:.1f} s: "
                     f"{exc}")
        return False
    return ending


def slow_peer_cpu(group, q, k, v) -> None:
    """Rank 1 arrives 3 s late; the others must not spin."""
    if group.rank == 1:
        time.sleep(3)
    t0, c0 = time.monotonic(), time.process_time()
    burstcu.attention(q, k, v, group, causal=True)
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    _say(f"rank {group.rank} waited {wall:.2f} s using {cpu:.3f} s of CPU")


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def subgroup_late(timeout: float) -> None:
    """A group over ranks 1 and 2 of the world (MPI's Split), whose rank 1 (the world's 2)
    arrives late: the message's group ranks come with the world's ranks they are. World rank 0,
    outside the group, waits for the job to end."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(0 if world.Get_rank() >= 1 else 1, world.Get_rank())
    if world.Get_rank() == 0:
        time.sleep(10 * timeout)
        return
    group = burstcu.init(comm=sub, backend="numpy", timeout=timeout)
    if group.rank == 1:
        time.sleep(10 * timeout)
    q, k, v, _ = _inputs(group)
    burstcu.attention(q, k, v, group)
    _say(f"rank {group.rank} finished")


def raise_in_second_group(timeout: float) -> None:
    """A group closed, a second one open, then a bug on rank 1 between two calls."""
    burstcu.init(backend="numpy", timeout=timeout).close()
    _raise_between_calls(burstcu.init(backend="numpy", timeout=timeout), "in its second group")


def raise_in_with_block(timeout: float) -> None:
    """A bug on rank 1 between two calls inside `with burstcu.init() as group:` (the block
    closes the group as the exception leaves it)."""
    with burstcu.init(backend="numpy", timeout=timeout) as group:
        _raise_between_calls(group, "inside its with block")


def caught_outside_with_block(timeout: float) -> None:
    """Rank 1's bug closes its group on the way out of `with burstcu.init() as group:`, and the
    program catches it outside (a top-level `except: log`) and ends normally."""
    try:
        raise_in_with_block(timeout)
    except RuntimeError as exc:
        _say(f"rank 1 caught {exc} and ends normally")


def init_again_after_close(timeout: float) -> None:
    """Rank 1 closes its group and calls `burstcu.init` again while the others make one more
    call on the first group."""
    group = burstcu.init(backend="numpy", timeout=timeout)
    q, k, v, _ = _inputs(group)
    burstcu.attention(q, k, v, group)
    if group.rank == 1:
        group.close()
        burstcu.init(backend="numpy", timeout=timeout)
    else:
        burstcu.attention(q, k, v, group)
    _say(f"rank {group.rank} finished")


def init_retried_after_timeout(timeout: float) -> None:
    """Rank 1 reaches init 1 s after the others, whose timeout is 0.2 s; every rank catches its
    error and calls init again."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        time.sleep(1)
    for attempt, seconds in (("first", 0.2), ("again", timeout)):
        t0 = time.monotonic()
        try:
            burstcu.init(backend="numpy", timeout=seconds).close()
            said = "made a group"
        except Exception as exc:  # noqa: BLE001 - said, whatever it is
            said = f"{type(exc).__name__}: {exc}"
        _say(f"rank {MPI.COMM_WORLD.Get_rank()} {attempt} after {time.monotonic() - t0:.1f} s: {said}")


def _raise_between_calls(group, where: str) -> None:
    q, k, v, _ = _inputs(group)
    burstcu.attention(q, k, v, group)
    if group.rank == 1:
        raise RuntimeError(f"user code failed on rank 1 {where}")
    burstcu.attention(q, k, v, group)
    _say(f"rank {group.rank} finished")


def finalize_with_group_open(timeout: float) -> None:
    """A program that calls MPI.Finalize() itself at its end, its group still open: nothing is
    sent after it (MPICH ends a process that calls MPI then)."""
    from mpi4py import MPI

    group = burstcu.init(backend="numpy", timeout=timeout)
    q, k, v, _ = _inputs(group)
    burstcu.attention(q, k, v, group)
    MPI.Finalize()
    _say(f"rank {group.rank} finished")


PROGRAMS = {"init_errors_caught": init_errors_caught, "build_hangs": build_hangs,   # whole ones
            "subgroup_late": subgroup_late, "raise_in_second_group": raise_in_second_group,
            "raise_in_with_block": raise_in_with_block,
            "caught_outside_with_block": caught_outside_with_block,
            "init_again_after_close": init_again_after_close,
            "init_retried_after_timeout": init_retried_after_timeout,
            "finalize_with_group_open": finalize_with_group_open}
ENDINGS = {"mismatched_calls": mismatched_calls, "slow_peer_cpu": slow_peer_cpu,
           "one_more_call_after_close": one_more_call(1, closes=True),
           "one_more_call_after_exit": one_more_call(1, closes=False),
           "one_more_call_after_rank0_exit": one_more_call(0, closes=False)}


def main(scenario: str, timeout: float) -> None:
    before_init(scenario)
    if scenario in PROGRAMS:
        return PROGRAMS[scenario](timeout)
    group = _init(scenario if scenario in BAD_INIT else None,
                  float("inf") if scenario == "wait_forever" else timeout,
                  burstcu.Link(gbps=1e-6) if scenario == "link_too_slow" else None)  # a bit/ms
    q, k, v, dout = _inputs(group)
    misbehave(scenario, group, timeout, q, k, v)
    if scenario in ENDINGS:
        if not ENDINGS[scenario](group, q, k, v):
            group.close()
        return
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
    if scenario == "os_exit_after_last_call":   # the others finish as if nothing happened,
        if group.rank != 1:                          # then rank 1 leaves, its group open
            _say(f"rank {group.rank} finished")
        group.barrier()
        if group.rank == 1:
            os._exit(0)
        group.close()
        return
    _say(f"rank {group.rank} finished")
    group.close()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
