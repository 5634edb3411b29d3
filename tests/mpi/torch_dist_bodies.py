"""Bodies for tests/transport/test_torch_dist.py, run by torchrun (`tests.mpi_run.run_torchrun`):
`burstcu.init(comm=<torch.distributed ProcessGroup>)` on processes that joined torch.distributed
over gloo and never import MPI."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

import burstcu
from tests.mpi.sharding_bodies import check_sharding
from tests.mpi.transport_bodies import allgather_blocks


def _world():
    import torch.distributed as dist

    return dist.group.WORLD


def _torch_group(**options):
    """burstcu's group over torch's world, checked to be torch's ranks and transport."""
    group = burstcu.init(comm=_world(), **options)
    assert (group.rank, group.size) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    assert group.transport.name == "torch.distributed" and group.comm is _world()
    return group


def allgather_blocks_over_torch() -> float:
    """`transport_bodies.allgather_blocks` over the torch group: the gloo all-gather blocks the
    host, counted in stats.wait_seconds."""
    with _torch_group(backend="numpy") as group:
        return allgather_blocks(group)


def attention_over_torch(strategies=("burst",), layout="zigzag", docs=(0, 5, 17, 30, 48),
                         packed=False):
    """A Sharding over the torch group, a group made and closed a strategy: forward and backward
    against float64 (tests/mpi/sharding_bodies.py), the payload counted on the way;
    {strategy: the check's result and "sent"}."""
    results = {}
    for strategy in strategies:
        group = _torch_group(backend="numpy")
        sent = {}
        real_close = group.close

        def close(group=group, sent=sent, real_close=real_close):
            sent["bytes"], sent["messages"] = group.stats.bytes_sent, group.stats.messages
            real_close()
        group.close = close
        result = check_sharding(group, layout, list(docs), False, packed, "float32", strategy)
        results[strategy] = dict(result, sent=sent)
    return results


def groups_the_program_makes():
    """What programs do around init: groups of their own made before burstcu's (a pair of ranks
    the others are not in), init, close and init again, a group in its own rank order (not
    sorted) and a sub-group as comm; each group's attention (allgather and burst) and unshard
    against a one-process run, usp where four ranks make both of its sub-groups real."""
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.new_group([0, 1])                       # the program's own groups, made before burstcu's
    rng = np.random.default_rng(3)
    Q, K, V = (rng.standard_normal((1, 24 * size, 4, 8)).astype(np.float32) for _ in range(3))
    one = burstcu.attention(Q, K, V, None, causal=True)
    report = {}

    def check(comm, label, strategies=("allgather", "burst")):
        for round_ in range(2):                  # init, close, init again over the same group
            with burstcu.init(comm=comm, backend="numpy", timeout=60) as group:
                sh = burstcu.Sharding(group, layout="zigzag")
                for strategy in strategies:
                    out = burstcu.attention(*(sh.shard(x) for x in (Q, K, V)), sh, causal=True,
                                            strategy=strategy)
                    err = float(np.abs(sh.unshard(out) - one).max())
                    report[f"{label} {strategy} {round_}"] = [group.rank, group.size, err]

    check(_world(), "world", ("allgather", "burst", "usp") if size % 2 == 0 else
          ("allgather", "burst"))
    backwards = dist.new_group(list(range(size))[::-1], sort_ranks=False)
    check(backwards, "reversed")                 # torch's own order: rank r is rank size-1-r
    pair = dist.new_group([0, 1])                # every rank makes it; two are in it
    if rank < 2:
        check(pair, "pair")
    return {"rank": rank, "report": report}


def a_torch_group_is_not_a_burstcu_group():
    """Passing torch's ProcessGroup where a burstcu group goes: a TypeError saying what to do."""
    x = np.ones((1, 4, 2, 8), np.float32)
    try:
        burstcu.attention(x, x, x, _world())
        return {"said": None}
    except TypeError as exc:
        return {"said": str(exc)}


def errors_reach_every_rank():
    """Over torch.distributed as over MPI: one rank's bad input is the same ValueError on every
    rank, before any data moves; afterwards the group still works (a barrier)."""
    group = _torch_group(backend="numpy")
    rng = np.random.default_rng(0)
    d = 16 if group.rank == group.size - 1 else 8   # the last rank's head dim differs
    q, k, v = (rng.standard_normal((1, 8, 2, dim)).astype(np.float32) for dim in (8, d, 8))
    try:
        burstcu.attention(q, k, v, group)
        said = None
    except ValueError as exc:
        said = str(exc)
    group.barrier()
    group.close()
    return {"said": said}


def init_disagreement():
    """Ranks passing different backends: init's agreement raises the same ValueError on each."""
    backend = "emulated" if int(os.environ["RANK"]) == 1 else "numpy"
    try:
        burstcu.init(comm=_world(), backend=backend).close()
        return {"said": None}
    except ValueError as exc:
        return {"said": str(exc)}


def a_missing_rank_is_named():
    """The last rank never calls attention: rank 0 waits `timeout` (2 s) in the agreement, names
    it, and its process ends (torchrun then stops the rest) long before the last rank would
    have woken up."""
    group = _torch_group(backend="numpy", timeout=2)
    if group.rank == group.size - 1:
        time.sleep(60)
        return {"woke": True}
    x = np.ones((1, 4, 2, 8), np.float32)
    burstcu.attention(x, x, x, group)
    return {"returned": True}


def an_interrupt_reaches_a_waiting_rank():
    """The last rank is busy for 60 s before its call; rank 0, waiting for it inside attention
    (timeout 100 s), gets SIGINT 1 s in: gloo's wait held the main thread until its deadline,
    so the KeyboardInterrupt came only then; now at once."""
    import signal
    import threading

    group = _torch_group(backend="numpy", timeout=100)
    if group.rank == group.size - 1:
        time.sleep(60)
        return {"woke": True}
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    x = np.ones((1, 4, 2, 8), np.float32)
    burstcu.attention(x, x, x, group)
    return {"returned": True}


def a_call_at_exit(folder: str):
    """A barrier in an `atexit` handler, as a program's own cleanup makes it: the waits of the
    main thread ran on an executor, which refuses work once the interpreter is shutting down."""
    import atexit

    group = _torch_group(backend="numpy", timeout=60)

    def at_exit():
        group.barrier()
        (Path(folder) / f"rank{group.rank}").write_text("barrier at exit")
    atexit.register(at_exit)
    return {"registered": True}


_KEPT_TO_THE_END: list = []


def dropped_groups_and_an_allgather_last():
    """Five groups made and dropped without a close (each had started a waiting thread that
    nothing ended), then a group left open whose last call is an unshard (an allgather): gloo's
    thread could let go of its tensors last, at the interpreter's exit, which ended the process
    ("terminate called without an active exception") in about half the runs."""
    import gc
    import threading

    x = np.ones((1, 8 * int(os.environ["WORLD_SIZE"]), 2, 8), np.float32)
    for _ in range(5):
        sh = burstcu.Sharding(_torch_group(backend="numpy", timeout=60))
        burstcu.attention(sh.shard(x), sh.shard(x), sh.shard(x), sh)
        del sh
    gc.collect()
    waiting = sum(t.name == "burstcu-gloo-wait" for t in threading.enumerate())
    sh = burstcu.Sharding(_torch_group(backend="numpy", timeout=60))
    _KEPT_TO_THE_END.append(sh)
    out = sh.unshard(burstcu.attention(sh.shard(x), sh.shard(x), sh.shard(x), sh))
    return {"waiting_threads": waiting, "shape": list(out.shape)}


class _Communicator:
    """A stand-in for NCCL's communicator that records what it was made with."""
    made: list = []

    def __init__(self, size, uid, rank):
        self.made.append((size, bytes(uid).hex(), rank))

    def destroy(self):
        pass

    def abort(self):
        pass


def cupy_bootstrap_over_torch():
    """The "cupy" backend's NCCL bootstrap with torch.distributed as its host, on a stand-in
    CuPy (tests/fake_cupy.py; no GPU here): the device is the node-local rank, every rank makes
    its communicator with rank 0's unique id, metadata agrees over torch, and a sub-group
    (USP's split) connects with its own first rank's id."""
    from burstcu.transport import bootstrap
    from burstcu.transport.torch_dist import TorchDistTransport
    from tests.fake_cupy import FakeCupy

    rank = int(os.environ["RANK"])
    fake = FakeCupy(cc=(9, 0), n_devices=8)
    fake.module.cuda.nccl.get_unique_id = lambda: bytes([17 + len(_Communicator.made), rank]) * 64
    fake.module.cuda.nccl.NcclCommunicator = _Communicator
    for name, module in (("cupy", fake.module), ("cupy.cuda", fake.module.cuda),
                         ("cupy.cuda.nccl", fake.module.cuda.nccl)):
        sys.modules[name] = module
    os.environ.pop(bootstrap.BOUND_ENV, None)
    transport, device_id = bootstrap.bootstrap(TorchDistTransport(_world(), 60), 60)
    agreed = transport.allgather_object(rank * 10, "a check")
    sub = transport.split(0, -rank, "reversed")      # one sub-group of every rank, order reversed
    sub_agreed = sub.allgather_object(rank, "a check")
    transport.close()
    return {"device": device_id, "local_rank": int(os.environ["LOCAL_RANK"]),
            "made": _Communicator.made, "agreed": agreed, "sub": [sub.rank, sub.size],
            "sub_agreed": sub_agreed}


def init_without_a_peer():
    """The last rank never calls init: the others wait `timeout` (2 s) to connect burstcu's gloo
    group, say why and end their process (torchrun then stops the rest)."""
    if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
        time.sleep(60)
        return {"woke": True}
    burstcu.init(comm=_world(), backend="numpy", timeout=2)
    return {"returned": True}
