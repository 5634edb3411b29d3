"""Bodies for tests/transport/test_mpi.py, run on every rank under mpiexec (any world size)."""

from __future__ import annotations

import os
import time

import numpy as np

import burstcu
from burstcu.transport.link import Link


def _exchange(t, send, recv) -> None:
    _exchange_with(t, (send, recv, t.next_rank, t.prev_rank))


def _exchange_with(t, pair: tuple) -> None:
    """One exchange of `pair` (send, recv, dst, src), committed and waited for."""
    t.send_recv(*pair)
    t.commit()
    t.wait()


def waiting_for_a_late_peer(late_s: float = 0.015, rounds: int = 20, nbytes: int = 1 << 16) -> dict:
    """Ring exchanges in which rank 0 posts `late_s` late, `rounds` times: every other rank's
    progress thread waits for it. Process CPU time (both threads) over wall time, per rank."""
    with burstcu.init(backend="numpy") as group:
        t = group.transport
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        if group.size == 1:
            return {"cpu_s": 0.0, "wall_s": 0.0}
        _exchange(t, send, recv)
        group.barrier()
        c0, w0 = time.process_time(), time.monotonic()
        for _ in range(rounds):
            if group.rank == 0:
                time.sleep(late_s)
            _exchange(t, send, recv)
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
    assert wall >= 0.9 * rounds * late_s, (wall, rounds * late_s)
    return {"cpu_s": cpu, "wall_s": wall}


def link_paces_and_overlaps(gbps: float = 1.0, latency_us: float = 200.0, nbytes: int = 1 << 22) -> dict:
    """With burstcu.init(link=Link(gbps, latency_us)), on every rank:
    an exchange of `nbytes` each way takes at least the link's time for it;
    an exchange posted before 1.5x that much compute is hidden: wait returns at once (checked
    where every rank has a core: the progress thread needs one to finish the transfer);
    an all-gather of `nbytes` pieces takes at least G-1 link times (its G-1 messages each way);
    attention gives the same bits with the link as without;
    a slow exchange (0.4 s on the link) costs its waiting threads far less than 0.4 s of CPU."""
    link = Link(gbps=gbps, latency_us=latency_us)
    with burstcu.init(backend="numpy", link=link) as group:
        t, size = group.transport, group.size
        assert group.link == link and str(link) == f"emulated link {gbps:g} Gb/s, {latency_us:g} us"
        if size == 1:
            return {"size": 1}
        need = latency_us * 1e-6 + nbytes * 8 / (gbps * 1e9)   # the model, spelled out
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        _exchange(t, send, recv)
        out = {}
        group.barrier()
        t0 = time.monotonic()
        _exchange(t, send, recv)
        out["exchange_s"] = time.monotonic() - t0
        assert need <= out["exchange_s"] < need + 0.25, (out, need)

        a = np.random.default_rng(0).standard_normal((128, 128))
        group.barrier()
        t0 = time.monotonic()
        t.send_recv(send, recv, t.next_rank, t.prev_rank)
        t.commit()
        while time.monotonic() - t0 < 1.5 * need:      # compute while the link is busy
            a = np.tanh(a @ a)
        w0 = time.monotonic()
        t.wait()
        out["wait_after_compute_s"] = time.monotonic() - w0
        if size <= (os.cpu_count() or 1):
            assert out["wait_after_compute_s"] < 0.25 * need, (out, need)

        piece = nbytes // 4
        gathered = np.empty((size, piece), np.uint8)
        group.barrier()
        group.stats.reset()
        t0 = time.monotonic()
        t.allgather(send[:piece], gathered)
        out["allgather_s"] = time.monotonic() - t0
        gather_need = (size - 1) * (latency_us * 1e-6 + piece * 8 / (gbps * 1e9))
        assert gather_need <= out["allgather_s"] < gather_need + 0.25, (out, gather_need)
        assert group.stats.messages == size - 1, group.stats

        # pacing changes when data arrives, never what: the ring gives the same bits
        rng = np.random.default_rng(group.rank)
        q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
        paced = burstcu.attention(q, k, v, group, causal=True)
        with burstcu.init(backend="numpy") as plain:
            assert np.array_equal(paced, burstcu.attention(q, k, v, plain, causal=True))

    # a link slow enough that the wait is long: the waiting threads sleep through it
    slow = 0.4
    with burstcu.init(backend="numpy", link=Link(gbps=gbps, latency_us=slow * 1e6)) as group:
        t = group.transport
        small, got = np.ones(1 << 16, np.uint8), np.empty(1 << 16, np.uint8)
        group.barrier()
        c0, t0 = time.process_time(), time.monotonic()
        _exchange(t, small, got)
        out["slow_s"], out["slow_cpu_s"] = time.monotonic() - t0, time.process_time() - c0
        assert out["slow_s"] >= slow and out["slow_cpu_s"] < 0.05 * slow, out
    return out


def _wait_after_compute(group, pairs: list, compute_s: float) -> float | None:
    """After a barrier, post `pairs` [(send, recv, dst, src)] in one commit, compute (BLAS) for
    `compute_s`, then wait: the seconds the wait took (None: no pairs on this rank)."""
    t = group.transport
    a = np.random.default_rng(0).standard_normal((128, 128))
    group.barrier()
    if not pairs:
        return None
    t0 = time.monotonic()
    for pair in pairs:
        t.send_recv(*pair)
    t.commit()
    while time.monotonic() - t0 < compute_s:
        a = np.tanh(a @ a)
    w0 = time.monotonic()
    t.wait()
    return time.monotonic() - w0


def link_time_of_a_wait(progress: str, gbps: float = 0.1, nbytes: int = 1 << 20, repeats: int = 3) -> dict:
    """An exchange of `nbytes` each way (the ring), and one way (rank 0 to rank 1), posted before
    1.5x its link time of compute, over Link(gbps): the shortest of `repeats` waits over that
    link time, per case. With progress="inline" the data moves only in the wait, so the link's
    clock starts there: at least the whole link time, on every rank that sends or receives; with
    "thread" it ran behind the compute: little left (checked where every rank has a core)."""
    link = Link(gbps=gbps)
    with burstcu.init(backend="numpy", link=link, progress=progress) as group:
        t, size, rank = group.transport, group.size, group.rank
        if size == 1:
            return {"size": 1}
        need = link.seconds(nbytes)
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        _exchange(t, send, recv)   # the first exchange sets MPI's connections up
        ring = [(send, recv, t.next_rank, t.prev_rank)]
        one_way = [(send, None, 1, 0)] if rank == 0 else [(None, recv, 1, 0)] if rank == 1 else []
        out = {"need_s": need}
        for case, pairs in (("ring", ring), ("one_way", one_way)):
            waits = [_wait_after_compute(group, pairs, 1.5 * need) for _ in range(repeats)]
            out[case] = None if not pairs else min(waits) / need
    if progress == "inline":
        assert out["ring"] >= 0.5 and (out["one_way"] is None or out["one_way"] >= 0.5), out
    elif size <= (os.cpu_count() or 1):
        assert out["ring"] < 0.5 and (out["one_way"] is None or out["one_way"] < 0.5), out
    return out


def only_incomplete_peers_are_named(progress: str, stuck: str, timeout: float = 2.0,
                                    nbytes: int = 1 << 20) -> dict:
    """On 3 ranks, rank 0 sends `nbytes` to rank 1 and receives as many from rank 2 in one
    exchange; one side is left incomplete past `timeout`: stuck="send" (rank 1 does not take it
    yet; rank 2's message arrives), stuck="recv" (rank 2 does not send yet; rank 1 takes rank 0's
    message). Rank 0's CommTimeoutError must name only the peer of the incomplete request. Then
    the late side completes, so every rank ends clean. Every rank returns what it saw."""
    from burstcu.transport.base import CommTimeoutError

    with burstcu.init(backend="numpy", timeout=timeout, progress=progress) as group:
        t, rank = group.transport, group.rank
        assert group.size == 3, "needs 3 ranks"
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        on_time = {"send": 2, "recv": 1}[stuck]     # the peer whose side completes in time
        out = {"said": None}
        if rank == 0:
            t.send_recv(send, recv, 1, 2)
            t.commit()
            try:
                t.wait()
            except CommTimeoutError as exc:
                out["said"] = str(exc)
            assert out["said"] is not None, "the exchange completed: no side was left waiting"
            waited_for = out["said"].split(" for ", 1)[1].split(" during ")[0]
            want = "rank 1 to take this rank's message" if stuck == "send" else "rank 2's message"
            assert waited_for == want, out
        elif rank == on_time:    # rank 2 sends to rank 0, or rank 1 takes rank 0's message
            _exchange_with(t, (send, None, 0, 0) if rank == 2 else (None, recv, 0, 0))
            out["completed"] = True
        time.sleep(timeout if rank else 0.0)   # past rank 0's timeout, then the late side
        group.barrier()
        if rank == 3 - on_time:
            _exchange_with(t, (send, None, 0, 0) if rank == 2 else (None, recv, 0, 0))
            out["completed_late"] = True
        group.barrier()
    return out


def a_slow_link_is_named(progress: str, timeout: float = 1.0, nbytes: int = 1 << 20) -> dict:
    """Two ring exchanges committed, then one wait, over a link slower than the timeout (1 MiB at
    0.004 Gb/s: ~2 s each): every peer is on time, so every rank's CommTimeoutError names the
    link; the second exchange, queued behind the first, waits for no peer of its own. Every rank
    returns what it saw."""
    from burstcu.transport.base import CommTimeoutError

    with burstcu.init(backend="numpy", timeout=timeout, progress=progress,
                      link=burstcu.Link(gbps=0.004)) as group:
        t, said = group.transport, None
        bufs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(2)]
        for send, recv in bufs:
            t.send_recv(send, recv, t.next_rank, t.prev_rank)
            t.commit()
        try:
            t.wait()
        except CommTimeoutError as exc:
            said = str(exc)
        assert said is not None and "(emulated link 0.004 Gb/s, 0 us)" in said, said
        time.sleep(0.5)
    return {"said": said}


def compute_past_the_timeout_then_wait(progress: str, link: bool, timeout: float = 1.0) -> dict:
    """Rank 0 commits, computes 4 s (past timeout + 2 s), then waits; the next rank posts 3 s
    late, before rank 0's wait begins (over a link, its message takes 2.5 s more, hidden by the
    compute too). Rank 0's wait must return at once with the data: its progress thread gave
    up timeout + 2 s after the commit, and the wait raised CommTimeoutError at 0 s."""
    with burstcu.init(backend="numpy", timeout=timeout, progress=progress,
                      link=Link(gbps=0.004) if link else None) as group:   # 1.25 MB: 2.5 s
        t = group.transport
        send, recv = np.full(1_250_000, group.rank + 1, np.uint8), np.zeros(1_250_000, np.uint8)
        group.barrier()
        if group.rank == 1:
            time.sleep(3.0)
        t.send_recv(send, recv, t.next_rank, t.prev_rank)
        t.commit()
        time.sleep(4.0 if group.rank == 0 else 3.0)   # the next rank: its own link time hidden
        began = time.monotonic()
        t.wait()
        waited = time.monotonic() - began
        assert (recv == t.prev_rank + 1).all()
    return {"waited": waited}


def two_exchanges_given_up_then_waited(timeout: float = 2.0) -> dict:
    """Rank 0 commits a receive from rank 1, then one from rank 2, computes past both progress
    threads' giving up, then waits; neither peer posts. What rank 0's timeout says (it named
    the second peer only: the wait went on with the first exchange left and raised there)."""
    from burstcu.transport.base import CommTimeoutError

    with burstcu.init(backend="numpy", timeout=timeout) as group:
        said = None
        if group.rank == 0:
            t = group.transport
            pieces = [np.zeros(1024, np.uint8) for _ in range(2)]
            for peer, recv in zip((1, 2), pieces):
                t.send_recv(None, recv, peer, peer)
                t.commit()
            time.sleep(timeout + 2.5)
            try:
                t.wait()
            except CommTimeoutError as exc:
                said = str(exc)
        else:
            time.sleep(2 * timeout + 3)
    return {"said": said}


def an_exchange_never_waited_for() -> dict:
    """Rank 0 commits an exchange the next rank never posts, then ends its program without
    waiting or closing its group (a caught failure between commit and wait, say): its progress
    thread gives up 2 s past the timeout, so the interpreter's exit, which joins it, ends."""
    group = burstcu.init(backend="numpy", timeout=2.0)
    if group.rank == 0:
        t = group.transport
        t.send_recv(np.ones(1 << 20, np.uint8), np.empty(1 << 20, np.uint8), t.next_rank, t.prev_rank)
        t.commit()
    return {"rank": group.rank}


def two_groups_share_the_port(nbytes: int = 1_250_000) -> dict:
    """Two groups of the same ranks made with equal links, one message each way from each at
    once (two threads): the rank's one port carries both, so the later exchange ends after two
    link times (each group had a port of its own: both ended after one). Seconds each took."""
    import threading

    from mpi4py import MPI

    link = Link(gbps=0.02)   # 1.25 MB: 0.5 s
    groups = [burstcu.init(comm=MPI.COMM_WORLD, backend="numpy", link=Link(gbps=0.02))
              for _ in range(2)]
    took, start = {}, threading.Barrier(2)

    def exchange(index: int):
        t = groups[index].transport
        send, recv = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        start.wait()
        began = time.monotonic()
        _exchange(t, send, recv)
        took[index] = time.monotonic() - began
    for g in groups:
        g.barrier()
    threads = [threading.Thread(target=exchange, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for g in groups:
        g.close()
    return {"took": sorted(took.values()), "one": link.seconds(nbytes)}


def allgather_blocks(group, late_s: float = 0.3) -> float:
    """Rank 0 reaches a transport all-gather `late_s` seconds late: every other rank's host
    blocks for it, which `stats.wait_seconds` counts (checked here, on every rank; any
    transport whose all-gather blocks the host). This rank's wait_seconds."""
    t, size = group.transport, group.size
    piece, gathered = np.full(1024, group.rank, np.uint8), np.empty((size, 1024), np.uint8)
    group.barrier()
    if group.rank == 0:
        time.sleep(late_s)
    group.stats.reset()
    t.allgather(piece, gathered)
    assert (gathered == np.arange(size, dtype=np.uint8)[:, None]).all()
    if group.rank != 0:
        assert group.stats.wait_seconds >= 0.5 * late_s, (group.rank, group.stats)
    return group.stats.wait_seconds


def allgather_counts_as_waiting(gbps: float = 0.05) -> dict:
    """The allgather strategy's forward over Link(gbps): its all-gathers block the host for at
    least half their link time, counted in stats.wait_seconds on every rank (it read 0: only
    `wait` counted); then `allgather_blocks` over MPI."""
    link = Link(gbps=gbps)
    with burstcu.init(backend="numpy", link=link) as group:
        size = group.size
        if size == 1:
            return {"size": 1}
        rng = np.random.default_rng(0)
        q, k, v = (burstcu.shard(rng.standard_normal((1, 256 * size, 4, 32)).astype(np.float32), group)
                   for _ in range(3))
        group.barrier()
        group.stats.reset()
        burstcu.attention(q, k, v, group, strategy="allgather")
        stats = group.stats.as_dict()
        need = (size - 1) * link.seconds(stats["bytes_sent"] // (size - 1))   # no latency: one term
        assert stats["wait_seconds"] >= 0.5 * need > 0, (stats, need)
    with burstcu.init(backend="numpy") as group:
        late = allgather_blocks(group)
    return {"need_s": need, "wait_seconds": stats["wait_seconds"], "late_wait_seconds": late}


class _RunsCode:
    """Pickled, it calls open(path, "w") when unpickled: what a peer's pickle could do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def agreement_never_unpickles(marker: str) -> dict:
    """The last rank sends rank 0 a pickle that would create `marker` when unpickled, in place
    of its agreement message; the others agree as usual. Every rank learns that the last rank's
    message cannot be read (a ValueError naming it), and nothing ran: `marker` does not exist."""
    import pickle

    from mpi4py import MPI

    from burstcu.transport import mpi, wire

    with burstcu.init(backend="numpy") as group:
        t, last = group.transport, group.size - 1
        if group.size == 1:
            return {"skipped": "one rank"}
        if group.rank == last:
            request = t.comm.Isend([pickle.dumps(_RunsCode(marker)), MPI.BYTE], dest=0, tag=mpi._TAG_AGREE)
            deadline = time.monotonic() + 30
            while (answer := mpi._take(t.comm, 0)) is None:
                assert time.monotonic() < deadline, "no answer from rank 0"
                time.sleep(0.01)
            request.Wait()
            rank, why = wire.decode(answer)["unusable"]
            message = f"rank {rank}'s agreement message cannot be used: {why}"
        else:
            try:
                t.allgather_object(("shapes", 1), "probe")
            except ValueError as exc:
                message = str(exc)
            else:
                raise AssertionError("an unreadable agreement message was accepted")
        assert f"rank {last}'s agreement message cannot be used: it cannot be read" in message, message
        group.barrier()   # every rank has answered by now: the group still works
    assert not os.path.exists(marker), "a peer's pickle ran"
    return {"message": message}


def agreement_edges() -> dict:
    """Agreement rounds at their edges, on every rank: messages that add up past one message's
    bound (rank 0's answer carries them all); one rank whose value cannot be encoded (every
    rank raises, naming it, and the group goes on); and start-up gathers (`gather_plain`) of
    ranks in different rounds (every rank raises)."""
    from mpi4py import MPI

    from burstcu.transport import wire
    from burstcu.transport.mpi import gather_plain

    with burstcu.init(backend="numpy") as group:
        t, last = group.transport, group.size - 1
        big = "x" * (wire.MAX_BYTES // 2)
        assert t.allgather_object(big + str(group.rank), "large") == [big + str(r) for r in range(group.size)]
        messages = {}
        try:
            t.allgather_object(object() if group.rank == last else 1, "unencodable")
        except ValueError as exc:
            messages["unencodable"] = str(exc)
        assert f"rank {last}'s agreement message cannot be used: it cannot be encoded" in \
            messages.get("unencodable", ""), messages
        try:
            gather_plain(MPI.COMM_WORLD, 1, 30, "round B" if group.rank == last else "round A")
        except ValueError as exc:
            messages["rounds"] = str(exc)
        if group.size > 1:
            assert f"rank {last}: round B" in messages.get("rounds", ""), messages
        group.barrier()
    return messages


def users_receives_across_init() -> dict:
    """Receives of the user's own, posted before burstcu.init on its communicator with any tag
    (and any source), still pending through init and close, then given their messages: init's
    start-up gathers are collectives, which no receive matches, so each receive gets the user's
    message (point-to-point messages that named a late rank took them, and init timed out)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    pending = [comm.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG) for _ in range(size - 1)]
    for _ in range(3):   # init and close, over the world and a communicator split from it
        burstcu.init(backend="numpy", timeout=20).close()
        burstcu.init(comm=comm.Split(0, rank), backend="numpy", timeout=20).close()
    for r in range(size):
        if r != rank:
            comm.send(f"hello from {rank}", dest=r, tag=5)
    got = sorted(request.wait() for request in pending)
    comm.Barrier()
    return {"got": got}


def a_rank_outside_a_split() -> dict:
    """The last rank is left out of a Split (MPI.UNDEFINED: its communicator is MPI.COMM_NULL);
    the others make a group of size - 1 and run a call on it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sub = world.Split(MPI.UNDEFINED if rank == size - 1 else 0, rank)
    if rank == size - 1:
        try:
            burstcu.init(comm=sub, backend="numpy", timeout=20)
        except ValueError as exc:
            return {"raised": str(exc)}
        return {"raised": None}
    with burstcu.init(comm=sub, backend="numpy", timeout=20) as group:
        q = np.ones((1, 4, 1, 8))
        return {"size": group.size, "out": float(burstcu.attention(q, q, q, group).mean())}
