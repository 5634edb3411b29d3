"""The loopback transport (G ranks as threads sharing one device) on the CPU: the real engine and
strategies against the float64 reference on every rank, exact traffic, failures that end the world
instead of hanging, and the schedule it issues on a GPU proved race-free (burstcu.testing.schedule)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import burstcu
from burstcu import engine
from burstcu.engine import burst
from burstcu.testing import schedule
from burstcu.testing.world import RankFailed, run_ranks
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule
from burstcu.transport.base import CommTimeoutError
from burstcu.transport.loopback import LoopbackHub, LoopbackTransport, PeerFailedError
from tests.mpi.transport_bodies import allgather_blocks

EPS64 = 2.0**-52


def _problem(seed, n, h=4, hkv=2, d=16, b=1):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((b, n, h, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, n, hkv, d)) for _ in range(2))
    return q, k, v, dout


def _run(size, strategy, causal, layout, backend="numpy", dtype=np.float64, n=None, d=16):
    n = n or 16 * size
    q, k, v, dout = (x.astype(dtype) for x in _problem(size, n, d=d))

    def body(group):
        local = [burstcu.shard(x, group, layout) for x in (q, k, v, dout)]
        kw = dict(causal=causal, layout=layout, strategy=strategy)
        group.stats.reset()
        out, lse = burstcu.attention(*local[:3], group, return_lse=True, **kw)
        fwd = group.stats.as_dict()
        group.stats.reset()
        grads = burstcu.attention_backward(local[3], *local[:3], out, lse, group, **kw)
        bwd = group.stats.as_dict()
        return [burstcu.unshard(x, group, layout) for x in (out, *grads)], fwd, bwd, local

    return (q, k, v, dout), run_ranks(size, body, backend=backend)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["burst", "ring", "allgather"])
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "contiguous"),
                                           (True, "zigzag")])
def test_every_rank_matches_the_reference(size, strategy, causal, layout):
    (q, k, v, dout), results = _run(size, strategy, causal, layout)
    ref = [attention_ref(q, k, v, causal, dtype=np.longdouble)[0],
           *attention_backward_ref(dout, q, k, v, causal, dtype=np.longdouble)]
    naive = [attention_ref(q, k, v, causal)[0], *attention_backward_ref(dout, q, k, v, causal)]
    strategy_module = engine.get(strategy)
    for rank, (whole, fwd, bwd, local) in enumerate(results):
        for name, got, want, plain in zip(("out", "dq", "dk", "dv"), whole, ref, naive):
            ok, err, bound = within_fa_rule(got, want, plain, EPS64, factor=3.0)
            assert ok, f"rank {rank} {name}: {err:.3e} > {bound:.3e}"
        ql, kl, vl, _ = local
        mask = dict(rank=rank, layout=layout, causal=causal)
        want_fwd = strategy_module.forward_bytes(size, ql, kl, vl, **mask)
        want_bwd = strategy_module.backward_bytes(size, ql, kl, vl, **mask)
        assert (fwd["bytes_sent"], bwd["bytes_sent"]) == (want_fwd, want_bwd), rank
        if strategy == "allgather":   # the all-gather: a piece to each of G-1 ranks; then G-1 hops
            assert (fwd["messages"], bwd["messages"]) == (size - 1, 2 * (size - 1)), rank


@pytest.mark.emulated
def test_emulated_kernels_on_the_loopback_ring():
    """The CUDA kernels (CPU emulator) on a 2-rank loopback ring, zigzag causal, float16."""
    (q, k, v, dout), results = _run(2, "burst", True, "zigzag", backend="emulated",
                                    dtype=np.float16, n=64, d=32)
    ref = [attention_ref(q, k, v, True)[0], *attention_backward_ref(dout, q, k, v, True)]
    naive = [attention_ref(q, k, v, True, dtype=np.float32, round_to=np.float16)[0],
             *attention_backward_ref(dout, q, k, v, True, dtype=np.float32, round_to=np.float16,
                                    out_dtype=np.float16)]
    for rank, (whole, _, _, _) in enumerate(results):
        for name, got, want, plain in zip(("out", "dq", "dk", "dv"), whole, ref, naive):
            ok, err, bound = within_fa_rule(got.astype(np.float64), want, plain, 2.0**-23, 3.0)
            assert ok, f"rank {rank} {name}: {err:.3e} > {bound:.3e}"


def test_a_failing_rank_ends_the_world_with_its_name():
    def body(group):
        if group.rank == 2:
            raise MemoryError("simulated allocation failure")
        q = np.zeros((1, 8, 2, 8))
        return burstcu.attention(q, q, q, group)

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 2 failed: MemoryError") as info:
        run_ranks(3, body, timeout=60)
    assert info.value.rank == 2 and time.monotonic() - t0 < 10


def test_a_missing_peer_times_out_with_its_name():
    hub = LoopbackHub(2, timeout=0.5)
    from burstcu.transport.loopback import HostDevice
    t = LoopbackTransport(0, hub, HostDevice())
    buf = np.zeros(4)
    t.send_recv(buf, np.zeros(4), 1, 1)
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 1's message #0 to rank 0 \(step 1\); a peer may "
                                               r"also be still compiling kernels on first use"):
        t.commit()
    assert time.monotonic() - t0 < 5
    with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[1\]"):
        t.allgather_object("meta")


def test_abort_wakes_waiting_ranks():
    hub = LoopbackHub(2, timeout=60)
    hub.abort("rank 1 failed: boom")
    with pytest.raises(PeerFailedError, match="rank 1 failed: boom"):
        hub.allgather_object(0, None)


def test_message_sizes_must_agree():
    def body(group):
        t = group.transport
        t.send_recv(np.zeros(4 if group.rank == 0 else 8), np.zeros(4), t.next_rank, t.prev_rank)
        t.commit()
        t.wait()

    with pytest.raises(RankFailed, match="sent 64 bytes, rank 0 expected 32|sent 32 bytes"):
        run_ranks(2, body, timeout=10)


# ------------------------------------------------------------------------------------------------
# the GPU ordering: one happens-before graph over every rank's streams

@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_loopback_schedule_is_race_free(size, pass_, causal, layout):
    proved = schedule.prove_loopback(pass_, size, causal=causal, layout=layout)
    copies = sum(a.kind == "copy" for a in proved.actions)
    seqlen = schedule.SHAPE[1]
    messages = (sum(burst.forward_sends(r, size, seqlen, layout, causal) for r in range(size))
                if pass_ == "forward" else
                sum(burst.backward_counts(r, size, seqlen, layout, causal)[2] for r in range(size)))
    assert copies == messages


class _SkipsConfirmation(LoopbackTransport):
    """A seeded mistake: the sender does not wait for its receivers' copies before going on."""

    def _wait(self):
        self._unconfirmed = []
        super()._wait()


class _SkipsReady(LoopbackTransport):
    """A seeded mistake: the receiver copies without waiting for the sender's `ready` event."""

    def _receive(self, key, recv_buf, src):
        wait_event = self.device.wait_event
        self.device.wait_event = lambda stream, event: None
        try:
            super()._receive(key, recv_buf, src)
        finally:
            self.device.wait_event = wait_event


@pytest.mark.parametrize("mistake", [_SkipsConfirmation, _SkipsReady])
@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_seeded_ordering_mistakes_are_caught(mistake, pass_):
    recorded = schedule.record_loopback(pass_, 3, causal=False, layout="contiguous",
                                        transport_class=mistake)
    problems = schedule.check(recorded)
    assert problems and all("race" in str(p) for p in problems), schedule.report(problems)


# ------------------------------------------------------------------------------------------------
# the all-to-all strategies on the loopback: Ulysses, and USP's sub-groups (split)

@pytest.mark.parametrize("size,strategy", [(2, "ulysses"), (4, "ulysses"), (4, "usp"), (2, "usp")])
def test_all_to_all_strategies_match_the_reference(size, strategy):
    """4 query heads on 2 kv heads: Ulysses splits them over 2 or 4 ranks; USP at 4 ranks runs
    2 x 2 (its default degree there), sub-groups made by the loopback's split."""
    (q, k, v, dout), results = _run(size, strategy, True, "zigzag")
    ref = [attention_ref(q, k, v, True, dtype=np.longdouble)[0],
           *attention_backward_ref(dout, q, k, v, True, dtype=np.longdouble)]
    naive = [attention_ref(q, k, v, True)[0], *attention_backward_ref(dout, q, k, v, True)]
    strategy_module = engine.get(strategy)
    for rank, (whole, fwd, bwd, local) in enumerate(results):
        for name, got, want, plain in zip(("out", "dq", "dk", "dv"), whole, ref, naive):
            ok, err, bound = within_fa_rule(got, want, plain, EPS64, factor=3.0)
            assert ok, f"rank {rank} {name}: {err:.3e} > {bound:.3e}"
        ql, kl, vl, _ = local
        mask = dict(rank=rank, layout="zigzag", causal=True)
        assert fwd["bytes_sent"] == strategy_module.forward_bytes(size, ql, kl, vl, **mask), rank
        assert bwd["bytes_sent"] == strategy_module.backward_bytes(size, ql, kl, vl, **mask), rank
        assert fwd["messages"] == strategy_module.forward_messages(size, ql, kl, vl, **mask), rank
        assert bwd["messages"] == strategy_module.backward_messages(size, ql, kl, vl, **mask), rank


def test_a_failing_rank_inside_a_sub_group_ends_the_world():
    """USP 2 x 2: rank 3 raises inside the ring of its sub-group; every rank stops, named."""
    q, k, v, _ = (x.astype(np.float64) for x in _problem(4, 64, d=16))

    class Boom(RuntimeError):
        pass

    def body(group):
        local = [burstcu.shard(x, group, "zigzag") for x in (q, k, v)]
        if group.rank == 3:
            def failing(*args):
                raise Boom("injected")
            group.ops.forward_step = failing   # (the group is rank 3's alone)
        return burstcu.attention(*local, group, causal=True, layout="zigzag", strategy="usp",
                                 ulysses_degree=2)

    t0 = time.monotonic()
    with pytest.raises(RankFailed, match="rank 3"):
        run_ranks(4, body, timeout=30)
    assert time.monotonic() - t0 < 20


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("size,degree", [(4, 2), (6, 3), (4, 4)])
def test_usp_loopback_schedule_is_race_free(pass_, size, degree):
    schedule.prove_loopback(pass_, size, causal=True, layout="zigzag", strategy="usp",
                            options={"ulysses_degree": degree}, shape=(1, 4, 12, 12, 8))


@pytest.mark.parametrize("pass_", ["forward", "backward"])
@pytest.mark.parametrize("size,degree", [(4, 2), (6, 3)])
def test_usp_loopback_schedule_under_masks_uneven_shards_and_calls_in_a_row_is_race_free(pass_, size,
                                                                                         degree):
    """Windows and documents end the ring of groups' trips early, documents cut per-document
    zigzag give shards of different lengths, and calls in a row reuse the buffers the ops keep:
    the one graph over every rank's streams stays race-free."""
    from burstcu.layout import partition
    n = 4 * size
    uneven = partition("zigzag", size, n + 3, (0, 5, n + 3))
    assert not uneven.even
    for kw in [dict(causal=True, layout="zigzag", window_size=(3, 0)),
               dict(causal=False, layout="contiguous", window_size=(2, 2)),
               dict(causal=True, layout="contiguous", cu_seqlens=(0, 3, n // 2 + 1, n)),
               dict(causal=True, layout=uneven, cu_seqlens=(0, 5, n + 3)),
               dict(causal=True, layout="zigzag", calls=3, row_sums=True)]:
        schedule.prove_loopback(pass_, size, strategy="usp", options={"ulysses_degree": degree},
                                shape=(1, 4, 12, 12, 8), **kw)


@pytest.mark.parametrize("mistake", [_SkipsConfirmation, _SkipsReady])
def test_seeded_ordering_mistakes_in_usp_are_caught(mistake):
    recorded = schedule.record_loopback("backward", 4, causal=True, layout="zigzag", strategy="usp",
                                        options={"ulysses_degree": 2}, shape=(1, 4, 4, 4, 8),
                                        transport_class=mistake)
    problems = schedule.check(recorded)
    assert problems and all("race" in str(p) for p in problems), schedule.report(problems)


def test_a_sub_group_failure_wakes_the_whole_world():
    """A rank whose sub-group fails (its watchdog, a timeout in it) ends every rank, also those
    waiting in the parent group or in other sub-groups."""
    hub = LoopbackHub(4, timeout=30)
    from burstcu.transport.loopback import HostDevice
    errors: dict = {}

    def rank_main(rank):
        t = LoopbackTransport(rank, hub, HostDevice())
        try:
            sub = t.split(rank % 2, rank, "pairs")
            if rank == 0:
                sub.fail("rank 0: injected sub-group failure")
            else:
                t.allgather_object(None, "waiting in the parent")
        except PeerFailedError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert time.monotonic() - t0 < 10
    assert sorted(errors) == [1, 2, 3] and all("injected sub-group failure" in m for m in errors.values())


def test_a_late_peer_in_the_ring_counts_as_waiting():
    """A loopback commit blocks the host until the peer has posted the message it takes: a peer
    0.3 s late shows in stats.wait_seconds, whether the host waited in commit or in wait."""
    def body(group):
        t, buf = group.transport, np.zeros(256)
        group.barrier()
        if group.rank == 1:
            time.sleep(0.3)
        group.stats.reset()
        t.send_recv(buf.copy(), buf, t.next_rank, t.prev_rank)
        t.commit()
        t.wait()
        return group.stats.wait_seconds

    waits = run_ranks(2, body, timeout=30)
    assert waits[0] >= 0.15, waits


def test_an_all_gather_counts_as_waiting():
    """The loopback all-gather blocks the host until every rank has posted its piece: a peer
    0.3 s late shows in stats.wait_seconds (it read 0: only `wait` counted)."""
    waits = run_ranks(2, allgather_blocks, timeout=30)
    assert waits[1] >= 0.15, waits


def test_loopback_allgather_counts_what_it_receives():
    """An all-gather of 32 bytes on 3 ranks: each sends its 32 bytes to 2 peers and receives
    theirs."""
    def body(group):
        group.stats.reset()
        group.transport.allgather(np.ones(4), np.zeros(12))
        return group.stats.as_dict()

    for stats in run_ranks(3, body):
        assert stats["bytes_sent"] == stats["bytes_received"] == 2 * 32


def test_a_sub_group_made_after_an_abort_is_aborted():
    """A sub-hub made after its hub was aborted raises the abort at once, not at its timeout."""
    hub = LoopbackHub(2, timeout=3)
    hub.abort("rank 1 failed")
    sub = hub.subhub("ring", (0, 1))
    t0 = time.monotonic()
    with pytest.raises(PeerFailedError, match="rank 1 failed"):
        sub.take(("msg", 1, 0, 0), "a message")
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("leaving", [0, 1])
def test_a_call_that_a_rank_which_closed_its_group_never_made_fails_at_once(leaving):
    """One rank closes its group; the others make one more call (one more batch): they raise a
    ValueError at once naming the rank that left, not at their timeout (60 s here). A transport
    made again for that rank on the hub takes part in rounds again."""
    def body(group):
        sh = burstcu.Sharding(group)
        q, k, v, _ = (sh.shard(x) for x in _problem(0, 24, h=2, hkv=2))
        burstcu.attention(q, k, v, sh)
        if group.rank == leaving:
            group.close()
            return None
        t0 = time.monotonic()
        with pytest.raises(ValueError) as caught:
            burstcu.attention(q, k, v, sh)
        return str(caught.value), time.monotonic() - t0

    results = run_ranks(3, body, timeout=60)
    why = "group.close(), or the end of its with-block"
    for rank, result in enumerate(results):
        if rank == leaving:
            assert result is None
            continue
        said, seconds = result
        assert seconds < 10, result
        assert "more batches on some ranks than on others" in said, said
        calls = ["attention"] * 3
        calls[leaving] = f"no call: it has left the group ({why})"
        assert said.startswith("ranks are inside different burstcu calls (" + ", ".join(
            f"rank {r}: {call}" for r, call in enumerate(calls)) + ")"), said



def test_a_world_names_the_rank_whose_error_closed_its_group():
    """Rank 1's own error leaves its `with group:` block, which tells the peers it has left (with
    the error): run_ranks named rank 0, whose ValueError about the rank that left came first in
    rank order, and rank 1's traceback was lost."""
    def body(group):
        x = np.ones((1, 8, 2, 16))
        with group:
            burstcu.attention(x, x, x, group)
            if group.rank == 1:
                raise RuntimeError("the bug, on rank 1")
            burstcu.attention(x, x, x, group)

    with pytest.raises(RankFailed, match="rank 1 failed: RuntimeError: the bug, on rank 1") as info:
        run_ranks(2, body, timeout=30)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, RuntimeError)


def test_a_rank_that_closed_a_group_late_leaves_the_next_group_alone():
    """Each rank's k-th group on a hub meets the others' k-th: rank 0 closing its first group
    late (rank 1 already inside a round of its second, after a call rank 0 did not make) stands
    in for rank 0 in the first group's rounds only; the second groups agree as if nothing was."""
    from burstcu.transport.loopback import HostDevice
    hub, answers = LoopbackHub(2, timeout=30), {}

    def rank(r):
        first = LoopbackTransport(r, hub, HostDevice())
        first.allgather_object(r)
        if r == 0:
            time.sleep(0.3)
        else:   # a call rank 0 never makes: refused once rank 0 has left
            with pytest.raises(ValueError, match="rank 0: no call: it has left the group"):
                first.allgather_object("extra")
        first.close()
        second = LoopbackTransport(r, hub, HostDevice())
        answers[r] = [second.allgather_object(10 * r + i) for i in range(2)]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == {r: [[0, 10], [1, 11]] for r in (0, 1)}, answers
    assert hub._objects == {}


def test_loopback_agreement_rounds_are_dropped_once_read():
    """An allgather_object round every rank has read is forgotten (no memory grows per call)."""
    hub = LoopbackHub(2)
    threads = [threading.Thread(target=hub.allgather_object, args=(r, r)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hub._objects == {}


def test_an_interrupt_during_the_abort_grace_still_aborts(monkeypatch):
    """fail() prints, waits ABORT_GRACE_S for the launcher to read it, then aborts every rank: a
    second Ctrl-C in that wait must not skip the abort (the rank would leave through MPI's
    finalize while its peers wait out their timeout)."""
    from burstcu.transport import base

    class Recording(base.SelfTransport):
        aborted = None

        def _abort(self, reason):
            self.aborted = reason

    def interrupted(seconds):
        raise KeyboardInterrupt

    t = Recording()
    t.size = 2   # as a rank of two: fail() aborts
    monkeypatch.setattr(base.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t.fail("rank 0 failed in attention forward: KeyboardInterrupt")
    assert t.aborted == "rank 0 failed in attention forward: KeyboardInterrupt"
