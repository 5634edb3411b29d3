"""Nothing hangs: failures on one rank end the whole job quickly, with a message naming the failing
or missing rank, under a real `mpiexec -n 3` (each run under a time limit). The programs are
tests/mpi/faults.py, started as users start them: through launch/rank-guard and `python -m
mpi4py` (which aborts the world on an uncaught exception), or as a plain `python` program (where
burstcu's own hook does, once a group is open). Also: one rank's argument changed at
random in drawn calls raises on every rank (or, a change of form only, returns the same bits),
waiting does not spin, ranks inside different calls fail together, resident memory stays flat
over 1000 calls, and 4,500 init/close cycles leak no communicator (MPICH runs out after about
2,000 leaked)."""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_run import burstcu_run_mpiexec, mpiexec, run_mpi

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 4  # burstcu.init(timeout=...) in the programs: seconds a rank waits for a peer
# a timeout inside a call names a peer's first-use kernel compile as a cause, and the cure
COMPILING = "still compiling kernels on first use (the emulated and CUDA backends compile"


def run_faulty(scenario: str, ranks: int = 3, limit: float = 60, launcher: bool = False,
               plain: bool = False, timeout: float = TIMEOUT) -> tuple[int, str, float]:
    """(exit status, combined output, seconds) of tests/mpi/faults.py SCENARIO on `ranks`, whose
    burstcu.init waits `timeout` s for a peer: under mpiexec through launch/rank-guard and
    `python -m mpi4py`; with `launcher` through launch/burstcu-run (rank-guard and
    launch/mpi_first.py); `plain`: `mpiexec python faults.py`, nothing around it."""
    program = [str(ROOT / "tests" / "mpi" / "faults.py"), scenario, str(timeout)]
    if launcher:
        cmd = [str(ROOT / "launch" / "burstcu-run"), *burstcu_run_mpiexec(), "--cpu", "-n", str(ranks), "--",
               sys.executable, *program]
    elif plain:
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, *program]
    else:
        cmd = [mpiexec(), "-n", str(ranks), str(ROOT / "launch" / "rank-guard"), sys.executable, "-m",
               "mpi4py", *program]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHON=sys.executable,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{scenario} hung for {limit} s:\n{exc.stdout}\n{exc.stderr}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.parametrize("scenario,names", [
    # an exception in user code before the call: mpi4py aborts the world; the traceback names
    # the rank (MPICH's own abort line, "... - process 1", is not always flushed before the
    # launcher tears the job down on a loaded machine, so it is not required)
    ("raise_before_call", ["RuntimeError: user code failed on rank 1"]),
    ("interrupt_between_calls", ["KeyboardInterrupt"]),   # Ctrl-C on rank 1 between two calls
    # an exception inside a ring step: burstcu names the rank, call, step and cause, then aborts
    ("raise_in_step", ["burstcu: rank 1 failed in attention forward at 'fwd 1 compute': "
                       "MemoryError: simulated: out of memory"]),
    # a rank that exits early: the others are told at once; one that sleeps past the timeout:
    # rank 0 names the missing rank
    ("exit_early", ["ranks are inside different burstcu calls (rank 0: attention, rank 1: no call: "
                    "it has left the group (its program ended, or dropped the group, with the "
                    "group open), rank 2: attention)"]),
    ("sleep_past_timeout", [f"rank 0 waited {TIMEOUT} s for rank(s) [1]", "CommTimeoutError"]),
    # Ctrl-C (any exception) while the inputs are agreed on: the others are in the agreement
    ("interrupt_in_agreement", ["burstcu: rank 1 failed in attention forward at 'agreement on the "
                                "inputs': KeyboardInterrupt"]),
    # a late rank at a barrier, and a rank that never calls init
    ("barrier_late", [f"rank 0 failed in barrier at 'agreement on the inputs': CommTimeoutError: "
                      f"rank 0 waited {TIMEOUT} s for rank(s) [1]"]),
    ("exit_before_init", [f"waited {TIMEOUT} s for every rank of the communicator to reach "
                          f"burstcu.init"]),
    # bad arguments or environment on rank 1 alone: every rank raises, naming rank 1
    ("bad_timeout", ["rank 1: burstcu.init: timeout must be a positive number of seconds"]),
    ("bad_env_timeout", ["rank 1: burstcu.init: $BURSTCU_TIMEOUT must be a positive number"]),
    ("bad_link", ["rank 1: burstcu.init: link must be a burstcu.Link"]),
    ("bad_progress", ["rank 1: burstcu.init: progress must be one of"]),
    ("other_timeout", [f"burstcu.init: ranks disagree on timeout: rank 0 {float(TIMEOUT)}, "
                       f"rank 1 {float(2 * TIMEOUT)}"]),
    # rank 1's compiler hangs while it builds a kernel: past its build timeout it fails
    ("build_hangs", ["burstcu: rank 1 failed in attention forward at ", "BuildTimeoutError: waited 2 s "
                     "for the compiler command"]),
    # an emulated link too slow for the timeout: the wait names the link, not only the peer
    ("link_too_slow", [f"waited {TIMEOUT} s for rank 1's message", "(emulated link 1e-06 Gb/s, 0 us)",
                       "CommTimeoutError"]),
    # a group of some of the world's ranks: its rank numbers come with the world's
    ("subgroup_late", [f"rank 0 waited {TIMEOUT} s for rank(s) [1]",
                       "(ranks 0-1 of this group are ranks [1, 2] of the job)"]),
    # a rank killed mid-ring: rank-guard names it before mpiexec ends the others
    ("sigkill_mid_ring", ["burstcu: rank 1 on ", "died of signal 9"]),
])
def test_a_failure_on_one_rank_ends_the_job(scenario, names):
    status, out, seconds = run_faulty(scenario)
    assert status != 0, out
    assert seconds < 30, f"{scenario} took {seconds:.0f} s to end:\n{out}"
    for text in names:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert "finished" not in out  # no rank went on as if nothing happened
    assert "stops on an uncaught" not in out   # mpi4py's runner aborts; burstcu's hook stays out
    if scenario in ("sleep_past_timeout", "link_too_slow"):   # NumPy ranks compile nothing
        assert COMPILING not in out, out


@pytest.mark.parametrize("scenario,names", [
    # an exception on rank 1 before burstcu.init (before MPI is initialised): burstcu-run starts
    # every rank with MPI initialised, so mpi4py aborts the world (the traceback names the
    # rank, as in raise_before_call)
    ("raise_before_init", ["RuntimeError: user code failed on rank 1 before burstcu.init"]),
    # rank 1 leaves through os._exit(0) between two calls, its group open: rank-guard names it
    # and fails the job (the launcher alone may report success)
    ("os_exit_between_calls", ["burstcu: rank 1 on ", "exited (status 0) with 1 burstcu group(s) "
                               "open, without the interpreter's exit"]),
    # rank 1 leaves through os._exit(0) before burstcu.init: no group is open, but MPI has
    # started (launch/mpi_first.py), so MPICH's mpiexec ended the others at once with status 0
    ("os_exit_before_init", ["burstcu: rank 1 on ", "exited (status 0) without MPI_Finalize or the "
                             "interpreter's exit (os._exit?)"]),
])
def test_a_failure_on_one_rank_ends_a_launched_job(scenario, names):
    status, out, seconds = run_faulty(scenario, launcher=True)
    assert status != 0, out
    assert seconds < 30, f"{scenario} took {seconds:.0f} s to end:\n{out}"
    for text in names:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert "finished" not in out
    assert "stops on an uncaught" not in out   # launch/mpi_first.py runs mpi4py's runner


@pytest.mark.parametrize("ending,state", [
    ("MPI.Finalize()\nos._exit(0)\n", "exit"),   # finalized by the program, teardown skipped
    ("os._exit(0)\n", "running"),                 # no MPI_Finalize: rank-guard fails the job
    ("raise SystemExit(0)\n", "exit"),
])
def test_the_program_state_rank_guard_reads(tmp_path, ending, state):
    """launch/mpi_first.py's $BURSTCU_PROGRAM_STATE: "exit" once MPI is finalized, by the program
    itself too (then os._exit(0) is a clean end: it read "running", and rank-guard failed the
    job), or at the interpreter's exit; "running" where the process left without either. One
    process, no launcher (MPI as a singleton)."""
    program, file = tmp_path / "program.py", tmp_path / "state"
    program.write_text("import os\nfrom mpi4py import MPI\n" + ending)
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "mpi_first.py"), str(program)],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, BURSTCU_PROGRAM_STATE=str(file)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert file.read_text() == state + "\n"


@pytest.mark.parametrize("scenario,names", [
    # a bug in user code on rank 1 once its group is open: the traceback, then burstcu ends the
    # job (the others are inside their next call; they would wait out their 60 s)
    ("raise_before_call", ["RuntimeError: user code failed on rank 1 before calling burstcu",
                           "burstcu: rank 1 stops on an uncaught RuntimeError: user code failed"]),
    # Ctrl-C on rank 1 between two calls
    ("interrupt_between_calls", ["burstcu: rank 1 stops on an uncaught KeyboardInterrupt: "
                                 "interrupted (Ctrl-C or SIGINT) (outside any burstcu call"]),
    # the same in a second group, the first closed: the hook is set once and prints once
    ("raise_in_second_group", ["burstcu: rank 1 stops on an uncaught RuntimeError: user code "
                               "failed on rank 1 in its second group"]),
    # KVCache.append checks its rows without a message: rows of another shape on rank 1 alone
    # raised there as if every rank had, so the others waited in decode until the timeout
    ("bad_append_uncaught", ["ValueError: KVCache.append takes k, v of shape", "burstcu: rank 1 "
                             "stops on an uncaught ValueError: KVCache.append takes"]),
    # inside `with burstcu.init() as group:`, which closes the group as the exception passes
    ("raise_in_with_block", ["burstcu: rank 1 stops on an uncaught RuntimeError: user code failed "
                             "on rank 1 inside its with block (outside any burstcu call, its "
                             "group closed by it)"]),
])
def test_an_uncaught_exception_ends_a_plainly_launched_job(scenario, names):
    """`mpiexec python program.py`, no `-m mpi4py`: an exception no code catches on one rank
    while its group is open aborts every rank at once (burstcu.group.UncaughtEndsTheJob), well
    before the others' timeout, after the rank's traceback (printed once)."""
    status, out, seconds = run_faulty(scenario, plain=True, timeout=60)
    assert status != 0, out
    assert seconds < 30, f"{scenario} took {seconds:.0f} s to end:\n{out}"
    for text in names:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.index("Traceback (most recent call last)") < out.index("stops on an uncaught"), out
    assert "finished" not in out and "waited" not in out, out


def test_the_uncaught_hook_prints_then_ends_the_job_only_where_peers_would_wait(monkeypatch):
    """UncaughtEndsTheJob: the hook that was there prints first; then `fail` on the open group,
    also for an exception raised while handling an agreed one, or on a group the exception
    closed on its way out (or one raised from it); not for an error every rank raised, a group
    closed before, a group of one, a transport whose abort ends only this process,
    mpi4py's runner, an interactive session or a forked child of the rank. Set once: a second
    group neither chains the hook to itself nor comes back after the hook was put back."""
    from burstcu.group import UncaughtEndsTheJob

    said = []

    class Transport:
        abort_ends_every_rank = True

        def fail(self, reason):
            said.append(("fail", reason))

    class Group:
        rank, size, closed = 1, 2, False

        def __init__(self, transport=None):
            self.transport = transport or Transport()

    def printed(kind, exc, tb):
        said.append(("printed", kind))

    def hooked(exc) -> list:
        said.clear()
        sys.excepthook(type(exc), exc, None)
        return list(said)

    bug = RuntimeError("a bug")
    line = ("fail", "rank 1 stops on an uncaught RuntimeError: a bug (outside any burstcu call, its "
                    "group open)")
    monkeypatch.delattr(sys, "ps1", raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.run", raising=False)
    monkeypatch.setattr(sys, "excepthook", printed)
    watcher, first = UncaughtEndsTheJob(), Group()
    alone, torchlike = Group(), Group(Transport())
    alone.size, torchlike.transport.abort_ends_every_rank = 1, False
    for g in (alone, torchlike, first):
        watcher.watch(g)
    assert sys.excepthook == watcher.hook and len(watcher.groups) == 1
    assert hooked(bug) == [("printed", RuntimeError), line]

    first.closed, second = True, Group()
    assert hooked(bug) == [("printed", RuntimeError)]     # no group open
    watcher.watch(second)
    assert watcher.previous is printed and len(watcher.groups) == 1
    assert hooked(bug) == [("printed", RuntimeError), line]   # printed once, not recursing

    agreed = ValueError("bad input")
    agreed.burstcu_agreed = True
    assert hooked(agreed) == [("printed", ValueError)]
    try:   # rank 1's own bug while it handles the agreed error: the others may be waiting
        try:
            raise agreed
        except ValueError:
            raise RuntimeError("a bug") from None
    except RuntimeError as exc:
        assert hooked(exc) == [("printed", RuntimeError), line]

    with monkeypatch.context() as m:   # an interactive session: the prompt comes back
        m.setattr(sys, "ps1", ">>> ", raising=False)
        assert hooked(bug) == [("printed", RuntimeError)]
    with monkeypatch.context() as m:   # ... also where the program asks for it at its end
        m.setenv("PYTHONINSPECT", "1")
        assert hooked(bug) == [("printed", RuntimeError)]
    with monkeypatch.context() as m:   # mpi4py's runner aborts by itself, with its status
        m.setitem(sys.modules, "mpi4py.run", object())
        assert hooked(bug) == [("printed", RuntimeError)]
    watcher.pid = -1    # the hook runs in a forked child of the rank
    assert hooked(bug) == [("printed", RuntimeError)]
    watcher.pid = os.getpid()

    second.closed = True   # closed as the exception passed (`with`): that group ends the job
    for exc in (RuntimeError("a bug"), agreed):
        watcher.left(second, exc)
    assert hooked(agreed) == [("printed", ValueError)]
    assert hooked(bug) == [("printed", RuntimeError)]   # a group closed before it was raised
    closed_line = ("fail", line[1].replace("its group open", "its group closed by it"))
    passing, raised_from = RuntimeError("a bug"), RuntimeError("a bug")
    watcher.left(second, passing)
    raised_from.__cause__ = passing
    for exc in (passing, raised_from):
        assert hooked(exc) == [("printed", RuntimeError), closed_line]
    watcher.left(alone, bug)
    assert hooked(bug) == [("printed", RuntimeError)]   # a group of one keeps no one waiting

    monkeypatch.setattr(sys, "excepthook", printed)   # put back: a later group leaves it so
    watcher.watch(Group())
    assert sys.excepthook is printed


def test_an_error_every_rank_raises_ends_each_rank_without_an_abort():
    """Bad input on every rank, caught by no one, in a plainly launched job: each rank's
    traceback names it and each ends on its own; nothing aborts."""
    status, out, seconds = run_faulty("bad_input_uncaught", plain=True, timeout=60)
    assert status != 0 and seconds < 30, out
    assert out.count("ValueError: q is packed (T, H, D: no batch axis)") == 3, out
    assert "stops on an uncaught" not in out and "ends all" not in out and "MPI_Abort" not in out, out


def test_a_rank_that_leaves_through_os_exit_after_its_last_call_fails_the_job():
    """Rank 1 leaves through os._exit(0) after its last call, its group open, while the others
    finish as if nothing happened: only rank-guard can tell, and it fails the job."""
    status, out, seconds = run_faulty("os_exit_after_last_call", launcher=True)
    assert status != 0 and seconds < 30, out
    assert all(f"rank {r} finished" in out for r in (0, 2)), out
    assert "burstcu: rank 1 on " in out and "exited (status 0) with 1 burstcu group(s) open" in out, out


def test_bad_init_arguments_on_one_rank_raise_on_every_rank():
    """Each case of faults.BAD_INIT, caught: every rank raised, and the others' messages name
    rank 1."""
    from tests.mpi.faults import BAD_INIT

    status, out, seconds = run_faulty("init_errors_caught")
    assert status == 0 and seconds < 30, out
    for rank in range(3):
        for case in BAD_INIT:
            line = re.search(rf"^rank {rank} {case}: (\w+): (.*)$", out, re.MULTILINE)
            assert line, f"rank {rank} reported nothing for {case}:\n{out}"
            # the others name rank 1; rank 1 may raise its own message as it is
            assert line.group(1) in ("ValueError", "TypeError"), line.group(0)
            assert "rank 1" in line.group(2) or rank == 1, line.group(0)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 3])
def test_bad_arguments_on_one_rank_raise_on_every_rank(world):
    """Arguments that raised on their own rank before the agreement (a 0-d q, an lse reshaped
    in place, a decode's extra arguments), a KVCache capacity only the first append found to
    differ, an object array to unshard (which aborted the job) and a communicator as the group
    (an AttributeError): the same error on every rank, each naming its cause."""
    results = run_mpi(world, "friction_bodies:one_rank_bad_arguments_fail_on_every_rank", timeout=180)
    wanted = {"0-d q": "q must have 4 dimensions",
              "lse reshaped": "lse must have 3 dimensions",
              "cache_seqlens beside a KVCache": "pass no v_cache, group or cache_seqlens",
              "no v_cache": "needs v_cache",
              "KVCache capacity": "capacity_per_rank",
              "object dtype": "unshard takes arrays of numbers",
              "a communicator": "group must be a burstcu group from burstcu.init()"}
    for r in results:
        for case, text in wanted.items():
            assert text in r["messages"][case], (case, r["messages"][case])
    if world > 1:   # the rank whose argument it was is named on the others
        assert f"rank {world - 1}" in results[0]["messages"]["0-d q"]
        assert "rank 0" in results[0]["messages"]["KVCache capacity"] or \
            f"rank {world - 1}" in results[0]["messages"]["KVCache capacity"]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_rank_perturbed_calls_agree(world):
    """30 drawn calls (attention and its backward over every strategy and mask, linear
    attention, decode, a KVCache, unshard), each remade with every change that applies on one
    drawn rank (tests/mpi/perturbed_bodies.py): a change of the problem raises on every rank, a
    change of form returns the same bits, and every rank reaches the same outcome; none waits."""
    results = run_mpi(world, "perturbed_bodies:one_rank_perturbed_calls", timeout=240,
                      calls=30, seed=world)
    assert all(r == results[0] for r in results), results
    assert results[0]["refused unchanged"] == 0, results[0]   # every drawn call is a valid one
    assert results[0]["raises"] > 300 and results[0]["same"] > 60, results[0]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_one_rank_perturbed_adapter_calls_agree(world):
    """10 drawn calls through burstcu.torch and burstcu.jax (attention and linear attention,
    their backwards by torch autograd or jax.vjp, eager or under jax.jit; decode, from a KVCache
    too), each remade with every change that applies on one drawn rank, the adapters' own among
    them (a NumPy array for q, torch.autocast, jax.jit on one rank only): a change of the
    problem raises on every rank, one of form returns the same bits, the ranks' outcomes agree;
    none waits."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    results = run_mpi(world, "perturbed_bodies:one_rank_perturbed_adapter_calls", timeout=300,
                      calls=10, seed=world)
    assert all(r == results[0] for r in results), results
    assert results[0]["refused unchanged"] == 0, results[0]
    assert results[0]["raises"] > 100 and results[0]["same"] > 30, results[0]


@pytest.mark.mpi
def test_two_threads_calling_on_one_group_end_the_job():
    output = run_mpi(2, "friction_bodies:two_threads_on_one_group", timeout=120, expect_fail=True)
    assert "was called from another thread while attention forward runs on the same group" in output
    assert "give each thread its own group" in output


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("orders_differ", [False, True])
def test_calls_of_two_threads_in_different_orders_fail_on_every_rank(world, orders_differ):
    """Calls of two threads one after the other: in the same order on every rank they run (and
    thread names that differ between ranks only in their numbers, or inside burstcu.ordered_by,
    do not matter); in different orders they would pair one thread's data with the other's on
    a peer: the calls raise instead, on every rank."""
    results = run_mpi(world, "friction_bodies:threads_taking_turns", timeout=120,
                      orders_differ=orders_differ)
    failing = orders_differ and world > 1
    turns = [] if orders_differ else ["ordered", "unnamed"] + [f"pool {i}" for i in range(6)]
    for r in results:
        assert r["messages"] == (["alpha", "beta"] if failing else []), r
        assert r["calls"] == ([] if failing else sorted(["alpha", "beta"] + turns)), r


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2])
def test_init_from_threads_named_per_rank_says_to_call_it_from_one(world):
    results = run_mpi(world, "friction_bodies:init_from_threads_named_per_rank", timeout=120)
    assert [r["errors"] for r in results] == [int(world > 1)] * world


def test_a_group_of_one_takes_calls_from_threads_in_turn():
    """One process, no peers: calls from several threads wait their turn (the same bits as one
    at a time); close() while another thread is inside a call is refused."""
    import threading

    import numpy as np

    import burstcu
    from burstcu.group import Call

    rng = np.random.default_rng(0)
    xs = [tuple(rng.standard_normal((1, 600, 2, 16)).astype(np.float32) for _ in range(3))
          for _ in range(4)]
    want = [burstcu.attention(*x, causal=True) for x in xs]
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, burstcu.attention(*xs[i], causal=True)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(got[i], want[i]) for i in range(4))
    group = burstcu.init(backend="numpy")
    refused = []
    with Call(group, "attention forward"):
        t = threading.Thread(target=lambda: refused.append(pytest.raises(RuntimeError, group.close)))
        t.start()
        t.join()
    assert refused and "while another thread is inside attention forward" in str(refused[0].value)
    with Call(group, "outer"):             # a call inside this thread's own: its name comes back
        with Call(group, "inner"):
            assert group.transport.call == "inner"
        assert group.transport.call == "outer"
    assert group.transport.call is None
    # a call waiting for its turn while the group is closed under it: refused, not run
    waited = []
    with Call(group, "attention forward"):
        t = threading.Thread(target=lambda: waited.append(pytest.raises(
            ValueError, burstcu.attention, *xs[0], group)))
        t.start()
        t.join(0.2)
        group.close()                      # from the thread inside the call: allowed
    t.join()
    assert waited and "this group is closed" in str(waited[0].value)
    # a GPU group of one (an op on "cuda") takes no turn: calls from threads run side by side,
    # and close() from another thread mid-call is still refused
    from burstcu.group import Group
    from burstcu.ops.numpy import NumpyOps
    from burstcu.transport.base import SelfTransport

    ops = NumpyOps()
    ops.device = "cuda"
    gpu = Group(0, 1, "cupy", SelfTransport(), ops)
    both, done, refused = threading.Barrier(2, timeout=10), threading.Event(), []

    def beside():
        with Call(gpu, "decode"):
            both.wait()                   # inside its call while the main thread is in its own
            done.wait(10)

    side = threading.Thread(target=beside)
    side.start()
    with Call(gpu, "attention forward"):
        both.wait()
    t = threading.Thread(target=lambda: refused.append(pytest.raises(RuntimeError, gpu.close)))
    t.start()
    t.join()
    done.set()
    side.join()
    assert gpu.transport.call is None and not gpu.sharers
    gpu.close()
    assert refused and "while another thread is inside" in str(refused[0].value)


def test_timeout_inf_waits_without_a_deadline():
    """timeout=math.inf: the job runs as with any timeout (no overflow in any wait), rank 1
    arriving 1 s late."""
    status, out, _ = run_faulty("wait_forever")
    assert status == 0, out
    assert all(f"rank {r} finished" in out for r in range(3)), out


def test_ranks_inside_different_calls_fail_together():
    status, out, _ = run_faulty("mismatched_calls")
    assert status == 0, out
    for rank in range(3):
        assert f"rank {rank} caught: ranks are inside different burstcu calls (rank 0: attention, " \
               f"rank 1: barrier, rank 2: attention)" in out


@pytest.mark.parametrize("scenario,left,why", [
    ("one_more_call_after_close", 1, "group.close(), or the end of its with-block"),
    ("one_more_call_after_exit", 1, "its program ended, or dropped the group, with the group open"),
    ("one_more_call_after_rank0_exit", 0, "its program ended, or dropped the group, with the group "
                                          "open")])
def test_a_call_that_a_rank_which_left_never_made_fails_at_once(scenario, left, why):
    """A rank leaves its group (closes it, or its program ends with it open) while the others
    make one more call (an evaluation it does not make, one more batch): they fail at once with
    a ValueError naming the rank that left and why, not at their 600 s timeout; a second call
    after the first error was caught too."""
    status, out, seconds = run_faulty(scenario, limit=120, timeout=600)
    assert status == 0 and seconds < 60, out
    said = (f"rank 0 has left the group ({why}) while this rank is inside a burstcu call" if left == 0
            else f"ranks are inside different burstcu calls (rank 0: attention, rank 1: no call: it "
                 f"has left the group ({why}), rank 2: attention)")
    for rank, attempt in itertools.product({0, 1, 2} - {left}, (1, 2)):   # a second call too
        caught = re.search(rf"rank {rank} caught call {attempt} after ([0-9.]+) s: (.*)", out)
        assert caught and float(caught[1]) < 10 and caught[2].startswith(said), out
        assert "more batches on some ranks than on others" in caught[2], out
    assert f"rank {left} caught" not in out, out


@pytest.mark.parametrize("scenario,said", [
    # rank 1 catches its error outside the with-block it closed and ends normally
    ("caught_outside_with_block", "rank 1: no call: it has left the group (group.close(), or the "
                                  "end of its with-block, with an exception in flight there: "
                                  "RuntimeError: user code failed on rank 1 inside its with block)"),
    # rank 1 closes the group and waits in a second init while the others make one more call
    ("init_again_after_close", "rank 1: no call: it has left the group (group.close(), or the end "
                               "of its with-block)")])
def test_a_rank_that_left_while_its_peers_call_ends_the_job_at_once(scenario, said):
    """Both waited out the timeout: a group closed as an exception passed told no one, so the
    peers' next call waited for the rank that had caught it; and the peers' error about a rank
    that left was taken as raised on every rank alike (it is not raised where that rank is now),
    so nothing ended the job while rank 1 waited in its second init. Now the peers fail at once,
    naming rank 1's error, and their error, left uncaught, ends every rank (a plain `mpiexec`)."""
    status, out, seconds = run_faulty(scenario, plain=True, timeout=60)
    assert status != 0 and seconds < 30, f"{seconds:.0f} s:\n{out}"
    assert said in out and "stops on an uncaught ValueError: ranks are inside different" in out, out
    assert "waited" not in out and "rank 0 finished" not in out, out
    if scenario == "caught_outside_with_block":
        assert "rank 1 caught user code failed" in out and "cannot be made with that rank" in out


def test_an_init_retried_after_its_timeout_says_it_cannot_start():
    """A start-up gather that timed out stays posted (MPI cannot withdraw a collective), so a
    retried init paired with it on the ranks that came late: one rank read another round's
    bytes as a length ("rank 1 sent 3275633655786141026 bytes"), then ranks made groups the
    others did not. Now every rank's retry refuses at once, saying why."""
    status, out, seconds = run_faulty("init_retried_after_timeout", timeout=30, limit=90)
    assert status == 0 and seconds < 30, out
    for rank in range(3):
        first = re.search(rf"rank {rank} first after [0-9.]+ s: (.*)", out)
        again = re.search(rf"rank {rank} again after ([0-9.]+) s: (.*)", out)
        assert first and first[1].startswith("CommTimeoutError: "), out
        assert again and float(again[1]) < 1 and again[2].startswith(
            f"RuntimeError: rank {rank} cannot start burstcu.init (every rank must call it): an "
            f"earlier one timed out on this communicator"), out


def test_waiting_for_a_late_peer_does_not_spin():
    """Rank 1 arrives 3 s late: the others wait those 3 s using well under 1 s of CPU (the
    progress thread included: process CPU time)."""
    status, out, _ = run_faulty("slow_peer_cpu")
    assert status == 0, out
    for rank in (0, 2):
        found = re.search(rf"rank {rank} waited ([\d.]+) s using ([\d.]+) s of CPU", out)
        assert found, out
        wall, cpu = float(found.group(1)), float(found.group(2))
        assert wall > 2.5 and cpu < 1.0, found.group(0)


@pytest.mark.parametrize("call, subgroup, compiles, named", [
    ("attention forward", False, True, True),
    ("barrier", True, True, True),          # a sub-group's wait: the call is its parent's
    (None, False, True, False),             # between calls no kernel compiles
    ("burstcu.init", False, True, False),
    ("attention forward", False, False, False),   # a local op that compiles nothing (NumPy)
])
def test_a_timeout_inside_a_call_names_a_first_use_compile(call, subgroup, compiles, named):
    """A lowered timeout can end while a peer still compiles a kernel variant at its first call
    (under a causal contiguous layout only some ranks need some variants): the message says so,
    with the cure, where the group's local op compiles kernels; it used to name only failed,
    exited or busy peers."""
    from burstcu.transport.base import CommTimeoutError, SelfTransport
    top = SelfTransport(timeout=2)
    top.call, top.compiles_kernels = call, compiles
    t = top.split(0, 0, "ulysses") if subgroup else top
    said = str(t.timed_out("rank 1's message"))
    assert isinstance(t.timed_out("x"), CommTimeoutError)
    assert said.startswith("rank 0 waited 2 s for rank 1's message during ")
    assert (COMPILING in said and "warm the cache with python -m burstcu.build warm" in said) == named, said


def test_a_group_says_whether_its_local_op_compiles_kernels():
    """The first-use compile hint of a timeout follows the group's local op: the NumPy op
    compiles nothing, the kernel ops (the emulator here) build each variant at its first call."""
    import burstcu
    for backend, compiles in (("numpy", False), ("emulated", True)):
        with burstcu.init(backend=backend) as group:
            assert group.ops.compiles_on_first_use is compiles
            assert group.transport.compiles_kernels is compiles


def test_timeout_is_validated_and_reported():
    import burstcu
    with pytest.raises(ValueError, match="positive number of seconds"):
        burstcu.init(backend="numpy", timeout=0)
    with burstcu.init(backend="numpy", timeout=7.5) as group:
        assert group.timeout == 7.5
    os.environ["BURSTCU_TIMEOUT"] = "12"
    try:
        assert burstcu.init(backend="numpy").timeout == 12.0
    finally:
        del os.environ["BURSTCU_TIMEOUT"]


@pytest.mark.parametrize("value,env", [(math.inf, None), (None, "inf"), (None, "none"), (1e12, None)])
def test_timeout_inf_waits_forever_and_huge_ones_are_clamped(value, env, monkeypatch):
    """math.inf (or $BURSTCU_TIMEOUT inf / none) means wait forever; a timeout past what the
    platform can wait (1e12 s > threading.TIMEOUT_MAX on some, past time_t's range in a sleep)
    waits MAX_WAIT_S: every deadline stays finite, so no wait overflows."""
    import threading

    import numpy as np

    import burstcu
    from burstcu.transport.base import MAX_WAIT_S, deadline_after
    if env is None:
        monkeypatch.delenv("BURSTCU_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("BURSTCU_TIMEOUT", env)
    with burstcu.init(backend="numpy", timeout=value) as group:
        assert group.timeout == (math.inf if value is None else value)
        deadline = group.transport.deadline()
        assert math.isfinite(deadline) and deadline - time.monotonic() <= MAX_WAIT_S < threading.TIMEOUT_MAX
        q = np.ones((1, 8, 1, 8))
        assert np.allclose(burstcu.attention(q, q, q, group), 1.0)
    assert math.isfinite(deadline_after(math.inf))


def test_a_memory_error_in_the_input_checks_stays_a_memory_error(monkeypatch):
    """On one process and on every rank of a loopback world of 3 (the error on rank 1 alone):
    MemoryError, naming the rank, and the group still works afterwards."""
    import threading

    import numpy as np

    import burstcu
    from burstcu import api
    from burstcu.testing.world import run_ranks
    real = api.check_attention_call

    def short_of_memory_on_rank_1(ops, arrays, **kwargs):
        if threading.current_thread().name in ("MainThread", "burstcu-rank1"):
            raise MemoryError("simulated: cannot allocate")
        return real(ops, arrays, **kwargs)

    monkeypatch.setattr(api, "check_attention_call", short_of_memory_on_rank_1)
    q = np.ones((1, 8, 2, 8))
    with pytest.raises(MemoryError, match="simulated: cannot allocate"):
        burstcu.attention(q, q, q)

    def body(group):
        try:
            burstcu.attention(q, q, q, group)
        except MemoryError as exc:
            caught = str(exc)
        group.barrier()   # the group still works: every rank raised together
        return caught

    for rank, message in enumerate(run_ranks(3, body, timeout=30)):   # rank 1's, on every rank
        assert message.startswith("rank 1: ") and "simulated" in message
        assert "out of memory while taking the inputs" in message


def test_a_memory_error_on_one_rank_alone_inside_the_agreement_ends_the_group(monkeypatch):
    """Out of memory on rank 1 alone after the agreement round (while the layout is worked
    out): not an error the ranks agreed on, so the group ends at once (the other rank stops
    waiting, PeerFailedError) instead of waiting out its timeout."""
    import threading

    import numpy as np

    import burstcu
    from burstcu import api
    from burstcu.testing.world import run_ranks
    real = api.partition_of

    def short_of_memory_on_rank_1(*args, **kwargs):
        if threading.current_thread().name == "burstcu-rank1":
            raise MemoryError("simulated: cannot allocate")
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "partition_of", short_of_memory_on_rank_1)
    q = np.ones((1, 8, 2, 8))

    def body(group):
        started = time.monotonic()
        x = q + group.rank   # shards of their own (equal ones would warn: SameShardsWarning)
        try:
            burstcu.attention(x, x, x, group)
        except BaseException as exc:  # noqa: BLE001 - what each rank raised is the result
            return type(exc).__name__, time.monotonic() - started
        return None, time.monotonic() - started

    (kind0, seconds0), (kind1, _) = run_ranks(2, body, timeout=30)
    assert kind1 == "MemoryError" and kind0 == "PeerFailedError" and seconds0 < 10, (kind0, seconds0)


def test_masked_arrays_are_refused(monkeypatch):
    """A numpy.ma.MaskedArray would lose its mask: attention, shard and unshard refuse it."""
    import numpy as np

    import burstcu
    q = np.ones((1, 8, 2, 8))
    masked = np.ma.masked_array(q, mask=np.zeros_like(q, bool))
    with pytest.raises(TypeError, match="k is a numpy.ma.MaskedArray: burstcu would read its data"):
        burstcu.attention(q, masked, q)
    with pytest.raises(TypeError, match="x is a numpy.ma.MaskedArray"):
        burstcu.shard(masked, None)
    with pytest.raises(TypeError, match="x_local is a numpy.ma.MaskedArray"):
        burstcu.unshard(masked, None)
    with pytest.raises(TypeError, match="q is a numpy.ma.MaskedArray"):
        burstcu.linear_attention(masked, q, q)


@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_arrays_in_the_other_byte_order_are_refused_on_every_rank(backend):
    """A big-endian float64 array has the dtype name "float64": it was computed in float32 (the
    accumulation dtype tested dtype equality), decoded to NaN by the kernels, and mixed float32
    and float64 partials between ranks that passed different byte orders. Now one rank's
    byte-swapped input is a TypeError on every rank, for attention, linear attention (dout of its
    backward too) and decode."""
    import numpy as np

    import burstcu
    from burstcu.testing.world import run_ranks

    dtype = np.float64 if backend == "numpy" else np.float16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 16, 2, 16)).astype(dtype) for _ in range(3))
    seqlens = np.full(1, 16, np.int32)

    def body(group):
        swapped = q.astype(q.dtype.newbyteorder(">" if q.dtype.byteorder != ">" else "<"))
        mine = swapped if group.rank == 1 else q
        said = []
        calls = [lambda: burstcu.decode(mine[:, :1], k, v, group, cache_seqlens=seqlens)]
        if backend == "numpy":
            calls += [lambda: burstcu.attention(mine, k + group.rank, v, group),
                      lambda: burstcu.linear_attention(mine, k + group.rank, v, group),
                      lambda: burstcu.linear_attention_backward(mine, q, k + group.rank, v, group)]
        for call in calls:
            try:
                call()
                said.append(None)
            except TypeError as exc:
                said.append(str(exc))
        return said

    for rank, said in enumerate(run_ranks(2, body, backend=backend, timeout=60)):
        assert all(m is not None and "non-native byte order" in m for m in said), (rank, said)


@pytest.mark.parametrize("nprocs", [2])
def test_resident_memory_is_flat_over_1000_calls(nprocs):
    results = run_mpi(nprocs, "resource_bodies:soak", timeout=240)
    assert len(results) == nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_training_loop_runs_and_repeats_its_bits(nprocs):
    """Forward+backward steps with 16 MiB arrays a rank, then a mix of shapes, on every rank
    (tests/mpi/resource_bodies.py: training_loop)."""
    results = run_mpi(nprocs, "resource_bodies:training_loop", timeout=240)
    assert [r["calls"] for r in results] == [13] * nprocs


def test_4500_init_close_cycles_leak_no_communicator():
    results = run_mpi(2, "resource_bodies:init_close_cycles", timeout=240)
    assert [r["cycles"] for r in results] == [4500, 4500]


def test_a_program_that_finalizes_mpi_with_its_group_open_ends_cleanly():
    """Nothing burstcu does at the interpreter's exit (telling the peers it has left) touches MPI
    once the program has finalized it."""
    status, out, _ = run_faulty("finalize_with_group_open", plain=True, timeout=60)
    assert status == 0 and all(f"rank {r} finished" in out for r in range(3)), out
    assert "after finalizing" not in out, out


@pytest.mark.parametrize("world", [2, 3])
def test_a_closed_groups_notices_reach_no_later_communicator(world):
    """What closing sends (a notice that the rank has left) is taken before the communicator is
    freed: no later communicator, the user's included, ever sees a stray message."""
    for rank, r in enumerate(run_mpi(world, "resource_bodies:closed_groups_leave_no_message",
                                     timeout=240)):
        assert r["stray"] == 0 and r["parked"] <= 2, (rank, r)


def test_close_stops_worker_threads_and_a_closed_group_says_so():
    import threading

    import numpy as np

    import burstcu
    before = threading.active_count()
    for _ in range(20):
        with burstcu.init(backend="numpy", threads=4) as group:
            q = np.ones((2, 8, 4, 8))
            burstcu.attention(q, q, q, group)
    assert threading.active_count() <= before + 1
    with pytest.raises(ValueError, match="this group is closed"):
        burstcu.attention(q, q, q, group)
    with pytest.raises(ValueError, match="this group is closed"):
        group.barrier()
    # unshard on a closed group of one (no call's turn to take) returned the array
    for call in (lambda: burstcu.unshard(q, group), lambda: burstcu.Sharding(group).unshard(q)):
        with pytest.raises(ValueError, match="this group is closed"):
            call()
    group.close()  # again: nothing happens
