"""Bodies of tests/test_frictions.py that need several ranks: `burstcu.init`'s options under
`mpiexec -n N` (any N).

Run through tests/mpi/runner.py as `friction_bodies:<function>`.
"""

from __future__ import annotations

from mpi4py import MPI

import burstcu


def unknown_option_on_one_rank_fails_on_every_rank(backend: str = "numpy"):
    """The last rank passes an option its op does not take, the others deterministic=True:
    init raises the same TypeError on every rank, naming the option, the options the op takes
    and (elsewhere) the rank; then the world is still usable (a collective completes)."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    options = {"determinstic": True} if comm.Get_rank() == last else {"deterministic": True}
    try:
        burstcu.init(backend=backend, **options)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"init accepted {options}")
    assert "unknown option 'determinstic'" in message and "deterministic" in message, message
    if comm.Get_rank() != last:
        assert f"rank {last}" in message, message
    everyone = comm.allgather(message)
    return {"message": message, "ranks_failed": len(everyone)}


def bad_option_value_on_one_rank_fails_on_every_rank():
    """The last rank passes threads=1.5 to the NumPy op, the others threads=1: init raises the
    same TypeError on every rank (not the first call, on that rank alone)."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    try:
        burstcu.init(backend="numpy", threads=1.5 if comm.Get_rank() == last else 1)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError("init accepted threads=1.5")
    assert "threads must be an int, got 1.5" in message, message
    return {"ranks_failed": len(comm.allgather(message))}


def ranks_reading_other_kernel_sources_fail_on_every_rank():
    """The last rank reads its kernels from a copy of kernels/ with one header changed (another
    $BURSTCU_KERNEL_DIR, another checkout on another node): burstcu.init(backend="emulated")
    raises the same ValueError on every rank, naming the last rank's folder; a byte-identical
    copy in another folder is the same sources, and init goes on."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from burstcu.build.variants import kernel_dir

    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    copy = Path(tempfile.mkdtemp(prefix="burstcu-kernels-")) / "kernels"
    shutil.copytree(kernel_dir(), copy)
    messages = {}
    try:
        if comm.Get_rank() == last:
            os.environ["BURSTCU_KERNEL_DIR"] = str(copy)
        burstcu.init(backend="emulated").close()             # the same bytes elsewhere
        with open(copy / "common.cuh", "a") as f:
            f.write("\n// changed on one node\n")
        try:
            burstcu.init(backend="emulated").close()
        except ValueError as exc:
            messages["changed"] = str(exc)
    finally:
        os.environ.pop("BURSTCU_KERNEL_DIR", None)
        shutil.rmtree(copy.parent)
    return {"messages": messages, "world": comm.Get_size()}


def _raised(call, kind):
    """The message of the `kind` exception `call()` raises (an AssertionError if it returns)."""
    try:
        call()
    except kind as exc:
        return str(exc)
    raise AssertionError(f"{call} did not raise {kind.__name__}")


def one_rank_bad_arguments_fail_on_every_rank():
    """The last rank passes an argument no check used to reach before the agreement round, the
    others valid ones: every rank raises the same kind of error naming it (none waits for the
    timeout, none sees an internal IndexError/AttributeError), and the group still works."""
    import numpy as np

    comm = MPI.COMM_WORLD
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    odd = rank == last
    group = burstcu.init(backend="numpy", timeout=60)
    sh = burstcu.Sharding(group)
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal((1, 4 * group.size, 2, 8)).astype(np.float32) for _ in range(4))
    q, k, v, dout = (sh.shard(x) for x in (Q, K, V, dO))
    out, lse = burstcu.attention(q, k, v, sh, causal=True, return_lse=True)
    seen = {}
    # a 0-d q to the backward (its head dim was read before the agreement)
    seen["0-d q"] = _raised(lambda: burstcu.attention_backward(
        dout, np.array(1, np.float32) if odd else q, k, v, out, lse, sh, causal=True), ValueError)
    # lse reshaped in place to fewer axes (its remembered cut was read along a lost axis)
    flat = lse.copy()
    if odd:
        flat.shape = (flat.shape[0] * flat.shape[1], flat.shape[2])
    seen["lse reshaped"] = _raised(lambda: burstcu.attention_backward(
        dout, q, k, v, out, flat, sh, causal=True), ValueError)
    # decode: row counts beside a KVCache, or no v_cache, on one rank (raised there alone)
    cache = burstcu.KVCache(group, 1, 4, 2, 8, np.float32)
    cache.append(rng.standard_normal((1, 3, 2, 8)).astype(np.float32),
                 rng.standard_normal((1, 3, 2, 8)).astype(np.float32))
    qd = np.ones((1, 1, 2, 8), np.float32)
    seen["cache_seqlens beside a KVCache"] = _raised(lambda: burstcu.decode(
        qd, cache, cache_seqlens=np.array([1]) if odd else None), TypeError)
    seen["no v_cache"] = _raised(lambda: burstcu.decode(
        qd, cache.k, None if odd else cache.v, group, cache_seqlens=cache.seqlens), TypeError)
    # a KVCache whose capacity differs on one rank (full there alone at the first append); on
    # one rank, one it refuses
    capacity = (3 if group.size > 1 else 0) if odd else 2
    seen["KVCache capacity"] = _raised(lambda: burstcu.KVCache(group, 1, capacity, 2, 8, np.float32),
                                       ValueError)
    # an object array to unshard on every rank (it passed the agreement, then aborted the job)
    seen["object dtype"] = _raised(lambda: burstcu.unshard(q.astype(object), group), TypeError)
    # the mpi4py communicator where the group goes, on every rank
    seen["a communicator"] = _raised(lambda: burstcu.attention(q, k, v, comm), TypeError)
    group.barrier()                                  # still usable
    return {"messages": seen}


def two_threads_on_one_group():
    """Two threads of every rank call attention on one group at once: the job ends with the
    message on the rank that saw it (before, a thread's messages could pair with the other
    thread's call on another rank: a wrong result, status 0)."""
    import threading

    import numpy as np

    group = burstcu.init(backend="numpy", timeout=30)
    rng = np.random.default_rng(group.rank)
    q, k, v = (rng.standard_normal((1, 256, 2, 16)) for _ in range(3))
    inside = threading.Barrier(2)

    def call(scale):
        inside.wait()                 # both threads start together, many times over
        for _ in range(50):
            burstcu.attention(scale * q, k, v, group, causal=True)

    threads = [threading.Thread(target=call, args=(s,)) for s in (1.0, 0.5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"finished": True}


def threads_taking_turns(orders_differ: bool):
    """Threads of every rank make calls on one group one after the other (never at once): two
    named "alpha" and "beta", an attention and an unshard each. orders_differ: the odd ranks run
    beta first, so each call would pair one thread's rows with the other thread's on a peer
    (silently wrong before): all four calls raise the same ValueError on every rank, and the
    group still works. Else every rank runs them in one order, then calls from threads whose
    names differ between ranks only in their numbers (an unnamed thread after one only rank 0
    started; a pool's workers, after rank 0 made another pool and left more idle workers), then
    from threads named by the rank's parity inside `burstcu.ordered_by` (refused outside it):
    the results are those of the same calls from the main thread, bit for bit."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    group = burstcu.init(backend="numpy", timeout=60)
    rng = np.random.default_rng(group.rank)
    q, k, v = (rng.standard_normal((1, 64, 2, 16)) for _ in range(3))
    got, messages = {}, {}

    def call(name, scale):
        try:
            got[name] = (burstcu.attention(scale * q, k, v, group, causal=True)[0],
                         burstcu.unshard(scale * q, group))
        except ValueError as exc:
            messages[name] = [str(exc)]
            try:
                burstcu.unshard(scale * q, group)
            except ValueError as again:
                messages[name].append(str(again))

    def in_thread(name, scale, thread_name=None):
        thread = threading.Thread(target=call, args=(name, scale), name=thread_name)
        thread.start()
        thread.join()

    names = ["beta", "alpha"] if orders_differ and group.rank % 2 else ["alpha", "beta"]
    if not orders_differ and group.rank == 0:
        idle = threading.Thread(target=lambda: None)       # Python's numbers move on, here only
        idle.start()
        idle.join()
        with ThreadPoolExecutor(1) as other:
            other.submit(lambda: None).result()
    scales = {"alpha": 1.0, "beta": 0.5, "unnamed": 0.25, "ordered": 0.125}
    for name in names:
        in_thread(name, scales[name], name)
    if not orders_differ:
        in_thread("unnamed", scales["unnamed"])
        with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool:
            if group.rank == 0:   # idle workers take turns: rank 0's calls go to several
                list(pool.map(lambda _: threading.Event().wait(0.05), range(4)))
            for i in range(6):
                scales[f"pool {i}"] = 1.0 + i
                pool.submit(call, f"pool {i}", scales[f"pool {i}"]).result()
        parity = "odd" if group.rank % 2 else "even"
        in_thread("unordered", 0.125, f"worker-{parity}")

        def ordered():
            with burstcu.ordered_by("worker"):
                call("ordered", scales["ordered"])
        thread = threading.Thread(target=ordered, name=f"worker-{parity}")
        thread.start()
        thread.join()
    if orders_differ and group.size > 1:
        assert sorted(messages) == ["alpha", "beta"] and not got, (messages, sorted(got))
        for texts in messages.values():
            assert texts[0].startswith("ranks disagree in attention: calling thread: rank 0 "), texts
            assert texts[1].startswith("ranks disagree in unshard: calling thread: rank 0 "), texts
            assert all("give each thread its own group" in t for t in texts), texts
    else:
        if group.size > 1 and not orders_differ:
            assert list(messages) == ["unordered"], messages
            assert "rank 0 'worker-even', rank 1 'worker-odd'" in messages.pop("unordered")[0]
        else:
            messages.pop("unordered", None)
            got.pop("unordered", None)
        assert not messages, messages
        for name, (out, whole) in got.items():
            alone = burstcu.attention(scales[name] * q, k, v, group, causal=True)[0]
            assert np.array_equal(out, alone), name
            assert np.array_equal(whole, burstcu.unshard(scales[name] * q, group)), name
    group.barrier()
    return {"messages": sorted(messages), "calls": sorted(got)}


def init_from_threads_named_per_rank():
    """Every rank calls burstcu.init from a thread named by its rank's parity: on two ranks or
    more each raises a ValueError that says to call init from threads of one name (not to make
    another group); then init from the main thread makes a working group."""
    import threading

    import numpy as np

    errors = []

    def make():
        try:
            burstcu.init(backend="numpy", timeout=60).close()
        except ValueError as exc:
            errors.append(str(exc))

    from mpi4py import MPI
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    thread = threading.Thread(target=make, name="odd" if rank % 2 else "even")
    thread.start()
    thread.join()
    if size > 1:
        assert len(errors) == 1, errors
        assert errors[0].startswith("ranks disagree in burstcu.init (the local op): calling "
                                    "thread: rank 0 'even', rank 1 'odd'. "), errors
        assert "call it from a thread of the same name on every rank" in errors[0], errors
        assert "another burstcu.init" not in errors[0], errors
    else:
        assert not errors, errors
    with burstcu.init(backend="numpy", timeout=60) as group:
        whole = burstcu.unshard(np.full((1, 2), float(group.rank)), group)
        assert whole.tolist() == [[float(r) for r in range(group.size) for _ in range(2)]], whole
    return {"errors": len(errors)}
