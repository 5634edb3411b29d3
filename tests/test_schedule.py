"""The GPU ordering of the ring engine over NCCLTransport, proved race-free on the CPU, and the
checker shown to catch seeded mistakes (burstcu.testing.schedule)."""

from __future__ import annotations

import itertools
import re
import time

import numpy as np
import pytest

import burstcu
from burstcu import engine
from burstcu.engine import burst, ring, steps
from burstcu.testing import schedule
from burstcu.ops.base import DelegatingOps
from burstcu.transport.nccl import EventWatchdog, NCCLTransport

SIZES = range(1, 9)
PASSES = ("forward", "backward")
LAYOUTS = ("contiguous", "zigzag")
RINGS = ("burst", "ring")   # the strategies of ring steps over point-to-point messages


def _sent(recorded) -> tuple[int, int]:
    """(messages, bytes) one rank's recorded schedule sends, as `CommStats` counts them: each
    send, and each all-gather's piece to every other rank."""
    pieces = [(1, a.nbytes) if a.kind == "send" else (recorded.size - 1, a.nbytes * (recorded.size - 1))
              for a in recorded.actions if a.kind in ("send", "allgather")]
    return sum(n for n, _ in pieces), sum(b for _, b in pieces)


def _counted(strategy: str, pass_: str, size: int, rank: int, shape: tuple, **kw) -> tuple[int, int]:
    """(messages, bytes) the strategy's own formulas say `rank` sends, its arrays of `shape`."""
    b, s, h, hkv, d = shape
    q, k = np.empty((b, s, h, d), np.float16), np.empty((b, s, hkv, d), np.float16)
    run = engine.get_linear(strategy) if strategy in engine.LINEAR_NAMES else engine.get(strategy)
    messages, nbytes = ((run.forward_messages, run.forward_bytes) if pass_ == "forward" else
                        (run.backward_messages, run.backward_bytes))
    return messages(size, q, k, k, rank=rank, **kw), nbytes(size, q, k, k, rank=rank, **kw)


# every strategy a rank records alone on NCCL: the rings over point-to-point messages, the
# all-gather baseline (an all-gather, then a ring reduce-scatter), and linear attention's two
NCCL_STRATEGIES = RINGS + ("allgather",) + engine.LINEAR_NAMES


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy", NCCL_STRATEGIES)
def test_engine_schedule_is_race_free(size, pass_, causal, layout, strategy):
    """Race-free, paired without deadlock, and each rank sends the messages and bytes its
    strategy counts."""
    schedules = schedule.prove(pass_, size, causal=causal, layout=layout, strategy=strategy)
    assert len(schedules) == size
    for r, recorded in enumerate(schedules):
        assert _sent(recorded) == _counted(strategy, pass_, size, r, schedule.SHAPE, layout=layout,
                                           causal=causal)


def _uneven_partitions(size: int) -> list:
    """(partition, documents) pairs of `size` ranks holding different numbers of rows: contiguous
    shards of 1-5 rows, and documents cut per-document zigzag and held whole."""
    from burstcu.layout import partition
    lengths = tuple(1 + (3 * r + 1) % 5 for r in range(size))
    n = 4 * size + 3
    docs = (0, 3, 10, n) if n > 10 else (0, 3, n)
    return [(partition("contiguous", size, sum(lengths), lengths=lengths), None),
            (partition("zigzag", size, n, docs), docs), (partition("documents", size, n, docs), docs)]


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("strategy", NCCL_STRATEGIES)
def test_uneven_shards_schedules_are_race_free(size, pass_, causal, strategy):
    """Shards of different lengths (a Partition layout, each rank recorded with its own S):
    messages of different sizes pair up, in order, without races or deadlock, and each rank
    sends what its strategy counts for its own shard. Linear attention takes no documents: its
    uneven shards are contiguous ones."""
    linear = strategy in engine.LINEAR_NAMES
    cases = _uneven_partitions(size)[:1 if linear else None]
    assert any(not part.even for part, _ in cases)
    for part, docs in cases:
        masks = {} if linear else {"cu_seqlens": docs}
        schedules = schedule.prove(pass_, size, causal=causal, layout=part, strategy=strategy, **masks)
        for r, recorded in enumerate(schedules):
            shape = schedule.SHAPE[:1] + (part.lengths[r],) + schedule.SHAPE[2:]
            assert _sent(recorded) == _counted(strategy, pass_, size, r, shape, layout=part,
                                               causal=causal, **masks), (part.lengths, r)


@pytest.mark.parametrize("size", (1, 2, 3, 5))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("strategy", NCCL_STRATEGIES)
def test_calls_after_the_first_reuse_kept_buffers_without_races(size, pass_, strategy):
    """Three calls in a row on one op: the buffers an op keeps between calls (burst's message
    pairs) are written by the next call only after everything the last one issued on them is
    ordered before (the waits that end a call)."""
    one = schedule.record(pass_, size, 0, causal=True, layout="zigzag", strategy=strategy)
    schedules = schedule.proved([schedule.record(pass_, size, r, causal=True, layout="zigzag",
                                                 strategy=strategy, calls=3) for r in range(size)])
    assert _sent(schedules[0]) == tuple(3 * n for n in _sent(one))
    if strategy == "burst" and size > 1:      # the same kept buffers carry every call's blocks
        sent = {a.reads[0].buffer for a in schedules[0].actions if a.kind == "send"}
        assert sent == {a.reads[0].buffer for a in one.actions if a.kind == "send"}


def test_recorded_transport_counts_like_the_base_class():
    device = schedule.RecordingDevice()
    ops = schedule.RecordingOps(device)
    transport = NCCLTransport(1, 3, device)
    q = ops.new("q", (1, 4, 2, 8), np.float16)
    k, v = ops.new("k", (1, 4, 1, 8), np.float16), ops.new("v", (1, 4, 1, 8), np.float16)
    burst.forward(q, k, v, ops, transport, causal=False, softmax_scale=1.0, layout="contiguous")
    assert transport.stats.bytes_sent == burst.forward_bytes(3, q, k, v, rank=1)
    assert transport.stats.bytes_received == transport.stats.bytes_sent
    assert transport.stats.messages == 2 and transport.stats.steps == 2


def _ordering_actions(recorded):
    """The records and waits that order streams: a record of an event no stream waits on (the
    watchdog's `started`, which it only queries) orders nothing and is left out."""
    waited = {a.event for a in recorded.actions if a.kind == "wait"}
    return [a for a in recorded.actions
            if a.kind == "wait" or a.kind == "record" and a.event in waited]


def _assert_each_needed(recorded, actions=None) -> None:
    """Removing any one of `actions` (default: every record and wait that orders streams) from
    the recorded schedule leaves a race the checker reports."""
    for action in _ordering_actions(recorded) if actions is None else actions:
        assert schedule.check(schedule.drop_action(recorded, action.index)), (
            f"rank {recorded.rank}: removing {action.describe()} went unnoticed")


# Under a contiguous causal mask, steps whose blocks are all masked issue no compute; the waits
# around them are then provably redundant (the in-order comm stream and the next wait cover
# them), so "every removal is caught" holds for the configurations below.
NECESSARY = [("forward", False, "contiguous"), ("forward", True, "zigzag"),
             ("backward", False, "contiguous"), ("backward", True, "zigzag")]


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("pass_,causal,layout", NECESSARY)
@pytest.mark.parametrize("strategy", RINGS)
def test_removing_any_record_or_wait_is_caught(size, pass_, causal, layout, strategy):
    for rank in range(size):
        _assert_each_needed(schedule.record(pass_, size, rank, causal=causal, layout=layout,
                                            strategy=strategy))


def test_removed_compute_wait_is_explained():
    recorded = schedule.record("forward", 4, 1, causal=False, layout="contiguous")
    wait = [a for a in recorded.actions if a.kind == "wait" and a.stream == "compute"][1]
    assert "fwd 1 wait" in wait.label
    text = schedule.report(schedule.check(schedule.drop_action(recorded, wait.index)))
    # which buffer, which two actions, which step, which hazard
    assert "read-after-write race on buffer 'msg0(k,v)'" in text
    assert "recv on the comm stream (fwd 1 send/recv kv" in text
    assert "kernel on the compute stream (fwd 2 compute / forward_step)" in text


def test_removed_comm_wait_lets_a_receive_overwrite_what_a_kernel_reads():
    recorded = schedule.record("backward", 4, 1, causal=False, layout="contiguous")
    wait = [a for a in recorded.actions if a.kind == "wait" and a.stream == "comm"][2]
    text = schedule.report(schedule.check(schedule.drop_action(recorded, wait.index)))
    assert "write-after-read race on buffer 'msg1(dq,q,dout,delta,lse)'" in text
    assert "(bwd 1 compute / backward_step) reads it, then" in text
    assert "recv on the comm stream (bwd 2 send/recv dq..lse" in text
    # the dq the host added after step 1's wait may still be in flight when the send reads it
    assert "(add_, after 'bwd 1 wait') writes it" in text


@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("size", (2, 3, 5))
@pytest.mark.parametrize("strategy", RINGS)
def test_buffers_swapped_one_step_early_are_caught(pass_, size, strategy):
    for rank, group in itertools.product(range(size), range(size - 1)):
        recorded = schedule.record(pass_, size, rank, causal=False, layout="zigzag", strategy=strategy)
        problems = schedule.check(schedule.receive_into_current(recorded, group))
        assert problems, f"rank {rank}: receiving into the current buffer at group {group} unnoticed"
        text = schedule.report(problems)
        assert "write-after-read race" in text and "recv on the comm stream" in text


def test_wait_without_record_is_reported():
    recorded = schedule.record("forward", 2, 0, causal=False, layout="contiguous")
    first_record = next(a for a in recorded.actions if a.kind == "record")
    text = schedule.report(schedule.check(schedule.drop_action(recorded, first_record.index)))
    assert "which was never recorded before it: the wait orders nothing" in text


def test_mismatched_ranks_are_reported_as_a_hang():
    schedules = schedule.record_world("backward", 3, causal=True, layout="zigzag")
    assert schedule.check_world(schedules) == []
    send = next(a for a in schedules[1].actions if a.kind == "send" and a.group == 2)
    schedules[1] = schedule.drop_action(schedules[1], send.index)
    text = schedule.report(schedule.check_world(schedules))
    assert "recv on the comm stream" in text and "no matching send from rank 1" in text

    schedules = schedule.record_world("forward", 3, causal=False, layout="contiguous")
    schedules[2] = schedules[2].renumbered([a for a in schedules[2].actions if a.group != 1])
    text = schedule.report(schedule.check_world(schedules))
    assert "no matching recv at rank 2" in text and "no matching send from rank 2" in text


def test_groups_paired_out_of_order_are_a_deadlock():
    """Rank 0 sends in its group 0 what rank 1 receives in its group 1, and rank 1 sends in its
    group 0 what rank 0 receives in its group 1: each waits in group 0 for the other's group 1."""
    def rank(r):
        return schedule.Schedule(r, 2, [schedule.Action(0, "comm", "send", "early", peer=1 - r, group=0, nbytes=8),
                                 schedule.Action(1, "comm", "recv", "late", peer=1 - r, group=1, nbytes=8)], {})
    text = schedule.report(schedule.check_world([rank(0), rank(1)]))
    assert "deadlock" in text and "ranks [0, 1]" in text

    # the same around three ranks: each sends early to the next, receives late from the last
    def ring(r):
        return schedule.Schedule(r, 3, [schedule.Action(0, "comm", "send", "early", peer=(r + 1) % 3, group=0, nbytes=8),
                                 schedule.Action(1, "comm", "recv", "late", peer=(r - 1) % 3, group=1, nbytes=8)], {})
    assert "deadlock" in schedule.report(schedule.check_world([ring(r) for r in range(3)]))

    # an all-gather before the exchange on one rank and after it on the other
    def gather_first(r):
        acts = [schedule.Action(0, "comm", "allgather", "g", group=0, nbytes=8),
                schedule.Action(1, "comm", "send", "x", peer=1 - r, group=1, nbytes=8),
                schedule.Action(2, "comm", "recv", "x", peer=1 - r, group=1, nbytes=8)]
        if r == 1:
            acts = [schedule.Action(0, "comm", "send", "x", peer=0, group=0, nbytes=8),
                    schedule.Action(1, "comm", "recv", "x", peer=0, group=0, nbytes=8),
                    schedule.Action(2, "comm", "allgather", "g", group=1, nbytes=8)]
        return schedule.Schedule(r, 2, acts, {})
    assert "deadlock" in schedule.report(schedule.check_world([gather_first(0), gather_first(1)]))
    # the same messages in matching groups are fine
    def ok(r):
        return schedule.Schedule(r, 2, [schedule.Action(0, "comm", "send", "x", peer=1 - r, group=0, nbytes=8),
                                 schedule.Action(1, "comm", "recv", "x", peer=1 - r, group=0, nbytes=8)], {})
    assert schedule.check_world([ok(0), ok(1)]) == []


def test_group_members_are_unordered_with_each_other():
    """A send and a receive of the same group run concurrently: overlapping them is a race even
    though they are on the same stream."""
    recorded = schedule.record("forward", 2, 0, causal=False, layout="contiguous")
    text = schedule.report(schedule.check(schedule.receive_into_current(recorded, 0)))
    assert "send on the comm stream" in text and "then #" in text


def _post_ungrouped(sends_first):
    """A seeded mistake: NCCLTransport._post without groupStart/groupEnd, each send and recv a
    blocking NCCL call of its own, a rank's sends before its receives where sends_first(rank),
    else after them."""
    def post(self, exchanges):
        dev = self.device
        with dev.annotate("burstcu commit"):
            started = self._begin()
            sends = [(dev.send, buf, dst) for buf, _, dst, _ in exchanges if buf is not None]
            recvs = [(dev.recv, buf, src) for _, buf, _, src in exchanges if buf is not None]
            for call, buf, peer in (sends + recvs if sends_first(self.rank) else recvs + sends):
                call(buf, peer, self.stream)
            self._arrived = self._end(started)
    return post


@pytest.mark.parametrize("strategy", RINGS)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("size", (2, 3, 5))
def test_ungrouped_blocking_sends_around_the_ring_are_a_deadlock(monkeypatch, strategy, pass_, size):
    """Every rank sends to its next before receiving from its previous, outside any NCCL group:
    each send waits for a receive its peer only posts after its own send — a deadlock."""
    monkeypatch.setattr(NCCLTransport, "_post", _post_ungrouped(lambda rank: True))
    cycle = re.escape(f"NCCL groups wait for each other in a cycle (ranks {list(range(size))})")
    with pytest.raises(schedule.ScheduleError, match=cycle + ".*a deadlock"):
        schedule.prove(pass_, size, causal=False, layout="zigzag", strategy=strategy)


@pytest.mark.parametrize("strategy", RINGS)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("size", (2, 3, 4, 5))
def test_ungrouped_sends_even_ranks_first_pair_up(monkeypatch, strategy, pass_, size):
    """The classic order without groups: even ranks send first, odd ranks receive first. The
    cycle breaks at an odd rank, so it is proved free of deadlock (and of races)."""
    monkeypatch.setattr(NCCLTransport, "_post", _post_ungrouped(lambda rank: rank % 2 == 0))
    schedules = schedule.prove(pass_, size, causal=False, layout="zigzag", strategy=strategy)
    calls = [a for a in schedules[0].actions if a.kind in ("send", "recv")]
    assert len({a.group for a in calls}) == len(calls)  # each call a group of its own


def _stage_sends(monkeypatch, keep_until_wait: bool) -> None:
    """A seeded mistake in the burst forward: each step sends a staging copy of its K/V span,
    made on the compute stream just before the commit, and keeps no reference to it after the
    commit (keep_until_wait: the staging copies live until the step's wait instead)."""
    kept = []

    def post_staged(ops, transport, label, messages):
        staged = [(None if send is None else steps.cast_copy(ops, send, np.uint8), recv, dst, src)
                  for send, recv, dst, src in messages]
        steps.post_messages(ops, transport, label, staged)
        if keep_until_wait:
            kept.append(staged)

    def wait_and_release(ops, transport, label):
        seconds = steps.timed_wait(ops, transport, label)
        kept.clear()
        return seconds

    monkeypatch.setattr(burst, "post_messages", post_staged)
    monkeypatch.setattr(burst, "timed_wait", wait_and_release)


@pytest.mark.parametrize("size", (2, 3, 5))
def test_a_staging_buffer_freed_while_nccl_sends_it_is_caught(monkeypatch, size):
    """NCCL reads a send buffer through a raw pointer: the buffer's last reference dying at the
    commit returns it to the pool, for the next allocation on the compute stream, while the comm
    stream still reads it. Kept until the wait, the same staging copies are race-free."""
    _stage_sends(monkeypatch, keep_until_wait=False)
    with pytest.raises(schedule.ScheduleError) as caught:
        schedule.prove("forward", size, causal=False, layout="contiguous")
    text = str(caught.value)
    assert "write-after-read race on buffer 'zeros'" in text
    assert "send on the comm stream (fwd 0 send/recv kv / burstcu commit / send to rank 1)" in text
    assert "free on the compute stream (free zeros, after 'fwd 0 send/recv kv')" in text
    assert "a free hands the bytes back to the memory pool" in text

    _stage_sends(monkeypatch, keep_until_wait=True)
    schedules = schedule.prove("forward", size, causal=False, layout="contiguous")
    assert sum(a.kind == "free" for a in schedules[0].actions) >= size - 1  # each staging copy


def test_ring_backward_folding_before_its_wait_is_caught(monkeypatch):
    """A seeded mistake in the ring strategy: its backward adds the step's partial dK, dV into
    the slot the step's exchange is still receiving into, and only then waits."""
    fold, deferred = ring._fold, []

    def wait_later(ops, transport, label):
        if not label.startswith("ring bwd ") or "return" in label:
            return steps.timed_wait(ops, transport, label)
        deferred.append((ops, transport, label))
        return 0.0

    def fold_then_wait(*args, **kw):
        fold(*args, **kw)
        while deferred:
            steps.timed_wait(*deferred.pop())

    monkeypatch.setattr(ring, "timed_wait", wait_later)
    monkeypatch.setattr(ring, "_fold", fold_then_wait)
    with pytest.raises(schedule.ScheduleError) as caught:
        schedule.prove("backward", 3, causal=False, layout="contiguous", strategy="ring")
    text = str(caught.value)
    assert "read-after-write race on buffer 'zeros'" in text
    assert "recv on the comm stream (ring bwd 1 send/recv / burstcu commit / recv from rank" in text
    assert "kernel on the compute stream (add_, after 'ring bwd 1 compute') reads it" in text


# ------------------------------------------------------------------------------------------------
# the NCCL transport's host-side watchdog, on the recording device

def test_watchdog_fires_when_an_exchange_never_completes():
    """A peer that never answers leaves the exchange's completion event pending: the watchdog
    reports the call and the step that stalled (the first: the later one queued behind it never
    starts) within its timeout (here 0.3 s), once, from its own thread."""
    device = schedule.RecordingDevice()
    device.stalled = True
    ops = schedule.RecordingOps(device)
    transport = NCCLTransport(1, 3, device, timeout=0.3)
    reasons = []
    transport.fail = reasons.append
    transport.call = "attention forward"
    q = ops.new("q", (1, 4, 2, 8), np.float16)
    k, v = ops.new("k", (1, 4, 1, 8), np.float16), ops.new("v", (1, 4, 1, 8), np.float16)
    t0 = time.monotonic()
    burst.forward(q, k, v, _Annotating(ops, transport), transport, causal=False, softmax_scale=1.0,
                  layout="contiguous")
    while not reasons and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert len(reasons) == 1 and 0.3 <= time.monotonic() - t0 < 3
    assert "rank 1: the NCCL exchange of attention forward at 'fwd 0 send/recv kv'" in reasons[0]
    assert "ranks 0 and 2 are its peers" in reasons[0]
    transport.close()


class _Timeline(schedule.RecordingDevice):
    """Events complete when a test says: `reached` (the comm stream is at that exchange: its
    `started` completes), `arrived` (the exchange completed), both sets of event names."""

    def __init__(self):
        super().__init__()
        self.reached, self.arrived = set(), set()

    def query(self, event):
        return event in self.reached or event in self.arrived


def _queue_exchanges(device, n, timeout, unreached_after=None):
    """An NCCL transport of rank 0 of 2 on `device` that queued `n` ring steps (the host does
    not block): (transport, reasons it failed with, [(started, arrived) events of each step])."""
    transport = NCCLTransport(0, 2, device, timeout=timeout)
    if unreached_after is not None:
        transport.watchdog.unreached_after = unreached_after
    reasons = []
    transport.fail = reasons.append
    transport.call = "attention forward"
    ops = schedule.RecordingOps(device)
    buf, steps = ops.new("buf", (16,), np.uint8), []
    for step in range(n):
        transport.where = f"fwd {step} send/recv"
        transport.send_recv(buf[:8], buf[8:], 1, 1)
        transport.commit()
        transport.wait()
        records = [a.event for a in device.actions if a.kind == "record" and a.stream == "comm"]
        steps.append(tuple(records[-2:]))
    return transport, reasons, steps


def _after(seconds, until):
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_watchdog_times_an_exchange_from_when_the_gpu_reaches_it():
    """The host queues three ring steps at once; the GPU is busy with compute for 3x the
    timeout before it reaches the first (no `started` complete): nothing fires. Each step then
    completes within the timeout: nothing fires. Then the comm stream reaches a step whose peer
    never answers: it fires once, within about the timeout, naming that step (not the last one
    queued). Before, the clock started when the host queued the exchange and fired in the
    compute."""
    device = _Timeline()
    transport, reasons, steps = _queue_exchanges(device, 3, timeout=0.5)
    (s0, a0), (s1, a1), (s2, a2) = steps
    assert len({s0, a0, s1, a1, s2, a2}) == 6, steps       # in flight together: own events
    time.sleep(1.5)
    assert reasons == [] and transport.watchdog.fired is None
    device.reached.add(s0)
    time.sleep(0.1)
    device.arrived.add(a0)
    device.reached.add(s1)
    time.sleep(0.1)
    device.arrived.add(a1)
    device.reached.add(s2)                                 # its peer never answers
    t0 = time.monotonic()
    _after(3, lambda: reasons)
    assert 0.4 <= time.monotonic() - t0 < 2 and len(reasons) == 1, reasons
    assert "the NCCL exchange of attention forward at 'fwd 2 send/recv' has not completed " \
           "after 0.5 s" in reasons[0], reasons
    transport.close()


def test_watchdog_names_the_oldest_exchange_that_never_completes():
    """Steps queued behind one whose peer never answers cannot start: the watchdog reports the
    stalled one (step 0), not the last the host queued, and only once."""
    device = _Timeline()
    transport, reasons, steps = _queue_exchanges(device, 4, timeout=0.2)
    device.reached.add(steps[0][0])
    _after(3, lambda: reasons)
    time.sleep(0.2)
    assert len(reasons) == 1 and "at 'fwd 0 send/recv' has not completed" in reasons[0], reasons
    transport.close()


@pytest.mark.parametrize("between", ["allgather", "commit"])
def test_watchdog_watches_exchanges_in_the_order_the_stream_runs_them(between):
    """Two exchanges posted before one wait (an all-gather, or a second commit, between a
    commit and its wait): the watchdog sees them in stream order, so the first stalling is
    reported, naming it; and the wait covers both."""
    device = _Timeline()
    transport = NCCLTransport(0, 2, device, timeout=0.2)
    reasons = []
    transport.fail = reasons.append
    transport.call = "attention forward"
    ops = schedule.RecordingOps(device)
    buf = ops.new("buf", (32,), np.uint8)
    transport.where = "first"
    transport.send_recv(buf[:8], buf[8:16], 1, 1)
    transport.commit()
    transport.where = "second"
    if between == "allgather":
        transport.allgather(buf[16:24], buf[16:32])
    else:
        transport.send_recv(buf[16:24], buf[24:32], 1, 1)
        transport.commit()
    transport.wait()
    comm = [a for a in device.actions if a.stream == "comm" and a.kind == "record"]
    waits = [a.event for a in device.actions if a.stream == "compute" and a.kind == "wait"]
    assert len(comm) == 4                                   # started, arrived of each exchange
    # the all-gather waits for itself; wait() follows the last commit
    assert waits[-1] == (comm[1] if between == "allgather" else comm[3]).event, (comm, waits)
    device.reached.add(comm[0].event)                       # the first one stalls
    _after(3, lambda: reasons)
    assert len(reasons) == 1 and "attention forward at 'first' has not completed" in reasons[0]
    transport.close()


def test_watchdog_retires_every_arrived_exchange_at_once():
    """2000 ring steps queued, all complete: one pass of the watchdog retires all of them with
    one query (one stream: the newest arrived, so did every other), and their events go back
    to the pools; with only the first 500 arrived, one pass retires those 500 and no more."""
    class _Counting(_Timeline):
        queries = 0

        def query(self, event):
            self.queries += 1
            return super().query(event)

    for arrived_first in (2000, 500):
        device = _Counting()
        transport = NCCLTransport(0, 2, device, timeout=5)
        dog = transport.watchdog
        dog.stop()                                           # this test drives the passes itself
        ops = schedule.RecordingOps(device)
        buf = ops.new("buf", (16,), np.uint8)
        for _ in range(2000):
            transport.send_recv(buf[:8], buf[8:], 1, 1)
            transport.commit()
            transport.wait()
        entries = list(dog._pending)
        device.arrived.update(exchange.arrived for exchange in entries[:arrived_first])
        device.queries = 0
        assert dog._retire_arrived()
        assert len(dog._pending) == 2000 - arrived_first
        assert len(dog._free["started"]) == len(dog._free["arrived"]) == arrived_first
        assert device.queries == (1 if arrived_first == 2000 else arrived_first + 2)
        transport.close()


def test_watchdog_reports_an_exchange_its_gpu_never_reaches():
    """A kernel before the oldest exchange never ends (its `started` never completes): after
    `unreached_after` seconds (max(4 x timeout, 1 h)) the watchdog reports it once, as this
    GPU's hang, not a peer's."""
    assert NCCLTransport(0, 2, _Timeline(), timeout=60).watchdog.unreached_after == 3600
    assert NCCLTransport(0, 2, _Timeline(), timeout=1000).watchdog.unreached_after == 4000
    t0 = time.monotonic()
    transport, reasons, steps = _queue_exchanges(_Timeline(), 2, timeout=60, unreached_after=0.3)
    _after(5, lambda: reasons)
    time.sleep(0.1)
    assert 0.3 <= time.monotonic() - t0 < 4 and len(reasons) == 1, reasons
    assert reasons[0] == ("rank 0: the NCCL exchange of attention forward at 'fwd 0 send/recv' has "
                          "not been reached by this rank's GPU after 0.3 s: a kernel queued before "
                          "it has not ended (a hang on this GPU, not a peer's)"), reasons
    transport.close()


def test_watchdog_hands_back_the_events_of_completed_exchanges():
    """Exchanges that completed give their events back: ten steps in turn, each seen complete
    before the next, use the same two events, and the transport makes no more than that."""
    device = schedule.RecordingDevice()
    transport = NCCLTransport(0, 2, device, timeout=5)
    ops = schedule.RecordingOps(device)
    buf, used = ops.new("buf", (16,), np.uint8), set()
    for _ in range(10):
        transport.send_recv(buf[:8], buf[8:], 1, 1)
        transport.commit()
        transport.wait()
        _after(3, lambda: not transport.watchdog._pending)
        used.update(a.event for a in device.actions if a.kind == "record" and a.stream == "comm")
    assert len(used) == 2 and device._events == 3, (used, device._events)   # + ready
    transport.close()


def test_watchdog_stays_quiet_when_exchanges_complete():
    device = schedule.RecordingDevice()
    fired = []
    dog = EventWatchdog(device, 0.1, fired.append, poll=0.01)
    dog.watch("event0", "event1", "step 0")
    time.sleep(0.3)
    assert fired == [] and dog.fired is None
    dog.stop()


def test_watchdog_queries_from_a_thread_on_the_ranks_gpu():
    """A thread starts on device 0: the watchdog binds its thread to the transport's GPU before
    its first query (else each rank would open a context on GPU 0)."""
    import threading

    seen = []

    class _Bound(schedule.RecordingDevice):
        def bind_thread(self):
            seen.append(("bind", threading.get_ident()))

        def query(self, event):
            seen.append(("query", threading.get_ident()))
            return super().query(event)

    dog = EventWatchdog(_Bound(), 5.0, lambda what: None, poll=0.01)
    dog.watch("event0", "event1", "step 0")
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert seen[0][0] == "bind" and seen[1][0] == "query"
    assert seen[0][1] == seen[1][1] != threading.get_ident()


def test_watchdog_reports_a_query_that_raises():
    """A CUDA error from the completion query (a sticky error on this GPU) ends the job with
    that error, at once, rather than killing the watchdog's thread and leaving a hang."""
    class _Broken(schedule.RecordingDevice):
        def query(self, event):
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    transport = NCCLTransport(0, 2, _Broken(), timeout=60)
    reasons = []
    transport.fail = reasons.append
    transport.watchdog.watch("event0", "event1", "attention forward at 'fwd 0 wait'")
    deadline = time.monotonic() + 5
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(reasons) == 1 and transport.watchdog.fired is not None
    assert reasons[0].startswith("rank 0: the NCCL exchange of attention forward at 'fwd 0 wait' "
                                 "failed on this rank's GPU (RuntimeError: cudaErrorIllegalAddress")
    transport.close()


def test_watchdog_that_cannot_bind_its_thread_says_so():
    """A watchdog whose thread cannot select the rank's GPU could watch nothing: it ends the
    job with that error rather than dying quietly (and leaving every exchange unwatched)."""
    class _Unbindable(schedule.RecordingDevice):
        def bind_thread(self):
            raise RuntimeError("cudaErrorDevicesUnavailable")

    errors = []
    dog = EventWatchdog(_Unbindable(), 60, lambda what: None, poll=0.01,
                        on_error=lambda what, exc: errors.append((what, str(exc))))
    dog.watch("event0", "event1", "step 0")
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert errors == [("binding the watchdog's thread to this rank's GPU", "cudaErrorDevicesUnavailable")]


class _Annotating(DelegatingOps):
    """The recording op, reporting the engine's annotations to the transport (as the API does)."""

    def __init__(self, inner, transport):
        super().__init__(inner)
        self.transport = transport

    def annotate(self, label):
        self.transport.where = label
        return self.inner.annotate(label)


# -- the all-to-all strategies ------------------------------------------------------------------

ULYSSES_SHAPE = (1, 4, 12, 12, 8)   # B, S, H, Hkv, D: 12 heads split over 1..4 ranks


@pytest.mark.parametrize("size", (1, 2, 3, 4))
@pytest.mark.parametrize("pass_", PASSES)
def test_ulysses_schedule_is_race_free(size, pass_):
    """Ulysses on the NCCL transport: the two all-to-alls (one group of send/recv to every peer
    each) ordered against the copies that fill and empty their buffers."""
    schedule.prove(pass_, size, causal=True, layout="zigzag", strategy="ulysses", shape=ULYSSES_SHAPE)


@pytest.mark.parametrize("pass_", PASSES)
def test_removing_any_record_or_wait_of_ulysses_is_caught(pass_):
    for rank in range(3):
        _assert_each_needed(schedule.record(pass_, 3, rank, causal=True, layout="zigzag",
                                            strategy="ulysses", shape=ULYSSES_SHAPE))


# Ulysses' data, byte by byte (`schedule.provenance`): the expectations below are written from
# the strategy's definition (rank j takes query heads [j*H/G, (j+1)*H/G) and the kv heads they
# read, h // (H/Hkv), of every row, in position order), not from burstcu.engine.ulysses

ULYSSES_HEADS = [(1, 4, 4), (1, 4, 1), (2, 4, 4), (2, 4, 2), (2, 4, 1), (2, 8, 2), (3, 6, 3),
                 (3, 3, 1), (3, 6, 6), (4, 4, 4), (4, 8, 2), (4, 4, 2), (4, 4, 1)]   # G, H, Hkv


def _ulysses_labels(pass_: str, positions: list, batch: int, h: int, hkv: int, d: int, row_sums: bool):
    """What `provenance` should find on each rank for Ulysses in float16 (float32 accumulation):
    [(kernel, labels of each array it reads, None: not compared)], and the labels of each array
    returned. Made elements carry one label on each of their bytes; a sum of several is ("+",
    terms sorted)."""
    it, acc, size = 2, 4, len(positions)
    rows = sorted((p, r, l) for r, ps in enumerate(positions) for l, p in enumerate(ps))
    rows = [(r, l) for _, r, l in rows]                      # the whole sequence, in order
    n, hg = len(rows), h // size
    heads = [list(range(j * hg, (j + 1) * hg)) for j in range(size)]       # query heads of j
    kv = [sorted({x // (h // hkv) for x in heads[j]}) for j in range(size)]  # the kv heads they read
    length = [len(ps) for ps in positions]

    def made(name, r, e, nbytes):
        return [("made", name, r, e)] * nbytes

    def summed(terms):
        return terms[0] if len(terms) == 1 else ("+",) + tuple(sorted(terms, key=str))

    def assembled(name, width, picked):   # (B, N, picked, D) of input `name` (B, S, width, D)
        return [(name, r, (((bb * length[r] + l) * width + x) * d + e) * it + b) for bb in range(batch)
                for r, l in rows for x in picked for e in range(d) for b in range(it)]

    def stats(j, name, delta):            # (B, Hg, N) of rank j's heads: lse as given, delta as made
        return [x for bb in range(batch) for hh in heads[j] for r, l in rows
                for x in (made("delta", r, (bb * h + hh) * length[r] + l, acc) if delta else
                          [("lse", r, ((bb * h + hh) * length[r] + l) * acc + b) for b in range(acc)])]

    reads, returned = [], []
    for j in range(size):
        mine = length[j]
        at = [rows.index((j, l)) for l in range(mine)]     # my rows' places in the sequence
        if pass_ == "forward":
            reads.append([("forward_init", [assembled("q", h, heads[j])]),
                          ("forward_step", [None, assembled("k", hkv, kv[j]), assembled("v", hkv, kv[j])])])
        else:
            whole = [[(name, j, o) for o in range(batch * mine * h * d * it)] for name in ("dout", "out")]
            reads.append([("backward_delta", whole),
                          ("backward_init", [assembled("k", hkv, kv[j]), assembled("v", hkv, kv[j])]),
                          ("backward_step", [None, assembled("q", h, heads[j]),
                                             assembled("dout", h, heads[j]),
                                             stats(j, "lse", False), stats(j, "delta", True),
                                             [schedule.ZERO] * batch * n * hg * d * acc]
                           + ([[schedule.ZERO] * batch * n * hg * acc] if row_sums else []))])

        def query_heads(name):   # (B, S, H, D) of my rows: head x made by rank x // hg as (B, N, Hg, D)
            return [x for bb in range(batch) for l in range(mine) for hh in range(h) for e in range(d)
                    for x in made(name, hh // hg, ((bb * n + at[l]) * hg + hh % hg) * d + e, it)]

        def kv_heads(name):      # (B, S, Hkv, D): kv head g, summed over the ranks reading it
            return [x for bb in range(batch) for l in range(mine) for g in range(hkv) for e in range(d)
                    for x in [summed([("made", name, i,
                                       ((bb * n + at[l]) * len(kv[i]) + kv[i].index(g)) * d + e)
                                      for i in range(size) if g in kv[i]])] * it]

        def per_row(name):       # (B, H, S) in the accumulation dtype, made as (B, Hg, N)
            return [x for bb in range(batch) for hh in range(h) for l in range(mine)
                    for x in made(name, hh // hg, (bb * hg + hh % hg) * n + at[l], acc)]

        if pass_ == "forward":
            returned.append([query_heads("out"), per_row("lse")])
        else:
            returned.append([query_heads("dq"), kv_heads("dk"), kv_heads("dv")]
                            + ([per_row("row_sums")] if row_sums else []))
    return reads, returned


def _assert_ulysses_moves(schedules, pass_, positions, shape, row_sums=False, calls=1):
    """Each rank's kernels read, and it returns, exactly the bytes `_ulysses_labels` says
    (shape: B, S, H, Hkv, D)."""
    batch, _, h, hkv, d = shape
    reads, returned = _ulysses_labels(pass_, positions, batch, h, hkv, d, row_sums)
    for r, (got_reads, got_returned) in enumerate(schedule.provenance(schedules)):
        assert [name for name, _ in got_reads] == [name for name, _ in reads[r]] * calls, r
        for (name, got), (_, want) in zip(got_reads, reads[r] * calls):
            assert len(got) == len(want), f"rank {r}: {name} reads {len(got)} arrays"
            for i, (x, y) in enumerate(zip(got, want)):
                assert y is None or x == y, f"rank {r}: {name} argument {i}"
        assert len(got_returned) == len(returned[r])
        for i, (x, y) in enumerate(zip(got_returned, returned[r])):
            assert x == y, f"rank {r}: returned array {i}"


@pytest.mark.parametrize("size,h,hkv", ULYSSES_HEADS)
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ulysses_moves_every_head_to_its_rank_and_back(size, h, hkv, pass_, layout):
    """Following the bytes through Ulysses' all-to-alls on NCCL: each rank attends over the
    whole sequence in position order with exactly its query heads and the kv heads they read,
    its backward reads its heads' lse and delta, and every output element comes home from the
    rank that owns its head; a kv head several ranks share comes home as the sum of each one's
    dk and dv. Two batch rows: every head slice is strided."""
    shape = (2, 4, h, hkv, 8)
    schedules = schedule.prove(pass_, size, causal=True, layout=layout, strategy="ulysses", shape=shape)
    _assert_ulysses_moves(schedules, pass_, _rows(layout, size), shape)


@pytest.mark.parametrize("size,h,hkv", [(2, 4, 2), (3, 6, 3), (4, 4, 1)])
@pytest.mark.parametrize("pass_", PASSES)
def test_ulysses_moves_uneven_shards_and_row_sums(size, h, hkv, pass_):
    """The same with shards of different lengths (contiguous, and documents cut per-document
    zigzag or held whole), with check=True's row sums, and over three calls in a row."""
    shape = (1, 4, h, hkv, 8)
    for part, docs in _uneven_partitions(size):
        schedules = schedule.prove(pass_, size, causal=True, layout=part, strategy="ulysses",
                                   shape=shape, cu_seqlens=docs, row_sums=True, calls=3)
        _assert_ulysses_moves(schedules, pass_, _rows(part, size), shape,
                              row_sums=pass_ == "backward", calls=3)


@pytest.mark.parametrize("shape,key", [((2, 5, 3, 4), (slice(None), slice(None), slice(1, 3))),
                                       ((2, 3, 5), (slice(None), slice(1, 2), slice(2, 5))),
                                       ((1, 4, 1, 8), (slice(None), slice(1, 3))),
                                       ((3, 1, 4, 2), (slice(0, 2), 0, slice(1, 4))),
                                       ((2, 3, 4), (1, slice(None), slice(0, 0))),
                                       ((4, 6), (slice(1, 3), slice(0, 6)))],
                         ids=str)
def test_a_fake_view_holds_the_bytes_numpy_says(shape, key):
    """`FakeArray.runs` (the bytes a view holds, in element order) against NumPy's own strides:
    the byte offset of each element of the same slice of a real array."""
    fake = schedule.FakeArray(0, 16, shape, np.float32)
    offsets = (np.arange(int(np.prod(shape))).reshape(shape) * 4 + 16)[key].ravel()
    held = [lo + b for lo, n in fake[key].runs() for b in range(n)]
    assert held == [int(o) + b for o in offsets for b in range(4)]
    region = fake[key].region
    assert region.lo == min(held, default=region.lo) and region.hi == max(held, default=region.hi - 1) + 1


# -- the all-gather strategies: the all-gather baseline, LASP-2, LASP-1's chains, decode --------

@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy", ("allgather", "lasp2"))
def test_removing_any_record_or_wait_of_the_gathering_strategies_is_caught(size, pass_, causal,
                                                                           layout, strategy):
    for rank in range(size):
        recorded = schedule.record(pass_, size, rank, causal=causal, layout=layout, strategy=strategy)
        assert any(a.kind == "allgather" for a in recorded.actions) == (strategy == "allgather")
        _assert_each_needed(recorded)


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_removing_a_wait_for_a_lasp1_state_is_caught(size, pass_, causal, layout):
    """LASP-1 waits after each hop it sends as well (the chain is sequential anyway): those
    waits are covered by the next one on the same comm stream, so only the waits for a received
    state, and what orders each send after the state it sends, must each be there."""
    for rank in range(size):
        recorded = schedule.record(pass_, size, rank, causal=causal, layout=layout, strategy="lasp1")
        waits = [a for a in recorded.actions if a.kind == "wait" and a.stream == "compute"
                 and " send " not in a.label and " total " not in a.label]
        assert len(waits) == sum(a.kind == "recv" for a in recorded.actions
                                 if " total " not in a.label)
        readies = [max((a for a in recorded.actions[:send.index]
                        if a.kind == "wait" and a.stream == send.stream), key=lambda a: a.index)
                   for send in recorded.actions if send.kind == "send" and " total " not in send.label]
        _assert_each_needed(recorded, waits + readies)


@pytest.mark.parametrize("strategy", engine.LINEAR_NAMES)
@pytest.mark.parametrize("pass_", PASSES)
def test_linear_outputs_before_the_states_arrive_are_caught(monkeypatch, strategy, pass_):
    """A seeded mistake in each linear strategy: it never waits for the states it receives, so
    its outputs read them while they are still arriving."""
    module = getattr(engine, strategy)
    monkeypatch.setattr(module, "timed_wait", lambda ops, transport, label: 0.0)
    with pytest.raises(schedule.ScheduleError) as caught:
        schedule.prove(pass_, 3, causal=True, layout="zigzag", strategy=strategy)
    text = str(caught.value)
    assert "read-after-write race on buffer 'zeros'" in text
    assert re.search(r"recv on the comm stream \(lasp[12] (fwd|bwd)", text), text


@pytest.mark.parametrize("size", (1, 2, 3, 4, 5))
@pytest.mark.parametrize("calls", (1, 3))
def test_decode_schedule_is_race_free(size, calls):
    """Decode's one all-gather of the partials, ordered against the partial the op writes in
    place and the merge that reads every rank's, over calls that reuse the op's kept buffers:
    each rank sends `decode_bytes` a call."""
    from burstcu.engine import decode
    schedules = schedule.proved([schedule.record_decode(size, r, calls=calls) for r in range(size)])
    b, t, h, _, d = schedule.DECODE_SHAPE
    q = np.empty((b, t, h, d), np.float16)
    for recorded in schedules:
        gathers = [a for a in recorded.actions if a.kind == "allgather"]
        assert len(gathers) == (calls if size > 1 else 0)
        assert _sent(recorded) == (calls * (size - 1), calls * decode.decode_bytes(size, q))
        assert len({a.writes[0].buffer for a in gathers}) <= 1     # the kept one, every call


@pytest.mark.parametrize("calls", (1, 2))
def test_removing_any_record_or_wait_of_decode_is_caught(calls):
    for rank in range(3):
        _assert_each_needed(schedule.record_decode(3, rank, calls=calls))


def test_fake_arrays_record_the_arithmetic_they_run():
    """The linear strategies' own arithmetic (a sum, a store into a slice, a cast, an integer
    index) runs on the compute stream: each a kernel that reads and writes the right bytes."""
    device = schedule.RecordingDevice()
    ops = schedule.RecordingOps(device)
    x = ops.new("x", (2, 3, 4), np.float32)
    y = ops.new("y", (3, 4), np.float32)
    assert x[1].shape == (3, 4) and x[1].region == schedule.Region(x.buffer, 48, 96)
    assert x[-1, 2].region == schedule.Region(x.buffer, 80, 96)
    assert x[...].region == x.region and x[0, ...].shape == (3, 4)
    total = x[1] + y
    x[0, 1:3] = total[:2]
    half = y.astype(np.float16)
    add, store, cast = [a for a in device.actions if a.kind == "kernel"]
    assert add.reads == (x[1].region, y.region) and add.writes == (total.region,)
    assert store.reads == (total[:2].region,) and store.writes == (schedule.Region(x.buffer, 16, 48),)
    assert cast.reads == (y.region,) and cast.writes == (half.region,) and half.dtype == np.float16
    assert total.buffer not in (x.buffer, y.buffer) and total.dtype == np.float32


@pytest.mark.parametrize("size", (2, 3, 5))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window", [(True, (1, 0)), (True, (3, -1)), (False, (0, 0)),
                                           (False, (2, 1))])
def test_windowed_schedules_are_race_free(size, pass_, layout, causal, window):
    """Windows end K/V trips early, so ranks send and receive in different steps: the one-sided
    exchanges still pair up, in order, without races or deadlock."""
    schedules = schedule.prove(pass_, size, causal=causal, layout=layout, window_size=window)
    if pass_ == "forward":
        sends = [sum(1 for a in sch.actions if a.kind == "send") for sch in schedules]
        assert sends == [burst.forward_sends(r, size, schedule.SHAPE[1], layout, causal, window)
                         for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_skipping_backward_with_documents_windows_and_row_sums_is_race_free(size, layout):
    """The backward's bundles stop where no rank needs them and their dQ (and row sums, under
    check=True) go home from there: every such schedule proved free of races and deadlocks."""
    n = schedule.SHAPE[1] * size
    docs = (0, 3, n // 2 + 1, n) if layout == "contiguous" else None
    for causal, window in ((True, (5, 0)), (False, (2, 3)), (False, (4, 0)), (True, (-1, -1))):
        for row_sums in (False, True):
            schedule.prove("backward", size, causal=causal, layout=layout, window_size=window,
                    cu_seqlens=docs, row_sums=row_sums)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pass_", PASSES)
def test_block_mask_schedules_are_race_free(size, layout, pass_):
    """Block masks end K/V and bundle trips where no rectangle needs them, at different steps on
    different ranks: the exchanges pair up without races or deadlock, and the forward sends what
    `forward_sends` counts."""
    n = schedule.SHAPE[1] * size
    mask = burstcu.BlockMask([[0, n // 2], [n // 2, n], [n - 1, n]], [[0, n // 2], [1, 3], [0, 1]],
                             ["causal", "full", "inverse_causal"])
    for row_sums in ((False, True) if pass_ == "backward" else (False,)):
        schedules = schedule.prove(pass_, size, causal=False, layout=layout, block_mask=mask,
                                   **({"row_sums": True} if row_sums else {}))
    if pass_ == "forward":
        sends = [sum(1 for a in sch.actions if a.kind == "send") for sch in schedules]
        assert sends == [burst.forward_sends(r, size, schedule.SHAPE[1], layout, block_mask=mask)
                         for r in range(size)]


# -- following the bytes: every block a rank needs, read once, from the right place ------------

def _rows(layout, size: int) -> list[list[int]]:
    """Each rank's rows' global positions, in local order: a layout name as the tests define it
    (`bodies.my_rows`, schedule.SHAPE's S rows a rank), a Partition as its runs say (the test's
    input there, not what it checks)."""
    from tests.mpi.bodies import my_rows
    if isinstance(layout, str):
        return [[int(p) for p in my_rows(layout, r, size, schedule.SHAPE[1] * size)] for r in range(size)]
    return [layout.positions(r) for r in range(size)]


def _kept_pairs(rows: list, keep) -> list[list[tuple]]:
    """kept[i][j]: the (local query row, local key row) pairs, sorted, that queries of rank i
    keep over keys of rank j. rows[r]: rank r's global positions, local row by row;
    keep(qpos, kpos): the dense mask over global positions."""
    return [[tuple(zip(*(x.tolist() for x in np.nonzero(keep(qi, kj))))) for kj in rows] for qi in rows]


TWO_WAY_MASKS = [dict(causal=False), dict(causal=True), dict(causal=False, window_size=(2, 2)),
                 dict(causal=False, window_size=(-1, 1)), dict(causal=False, window_size=(5, 0)),
                 dict(causal=True, window_size=(3, 0)), dict(causal=False, options={"bidirectional": True}),
                 dict(causal=False, window_size=(2, 2), options={"bidirectional": True})]


@pytest.mark.parametrize("size", range(1, 7))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", TWO_WAY_MASKS, ids=str)
def test_forward_reads_each_needed_block_once_and_sends_what_it_counts(size, layout, mask):
    """Replaying the recorded NCCL schedules of every rank, with each rank's K and V bytes
    labelled and the labels carried by copies and messages (`schedule.forward_blocks_read`):
    each rank's steps read exactly the blocks whose keys its queries see (written out here
    over positions, `bodies.dense_keep`), each once and as one block's K and V; the bytes and
    messages it sends are what the strategy counts."""
    from tests.mpi.bodies import dense_keep
    mask = dict(mask)
    options = mask.pop("options", None)
    schedules = schedule.prove("forward", size, layout=layout, options=options, **mask)
    read = schedule.forward_blocks_read(schedules)
    b, s, h, hkv, d = schedule.SHAPE
    rows = _rows(layout, size)
    window = mask.get("window_size", (-1, -1))
    kept = _kept_pairs(rows, lambda qpos, kpos: dense_keep(qpos, kpos, mask["causal"], window))
    for r in range(size):
        needed = [(j, kept[r][j]) for j in range(size) if kept[r][j]]
        assert sorted(read[r]) == needed, (r, read[r], needed)
    q, k = np.empty((b, s, h, d), np.float16), np.empty((b, s, hkv, d), np.float16)
    run = burst.BurstAttention(**(options or {}))
    for r, recorded in enumerate(schedules):
        sends = [a.nbytes for a in recorded.actions if a.kind == "send"]
        kw = dict(rank=r, layout=layout, **mask)
        assert sum(sends) == run.forward_bytes(size, q, k, k, **kw)
        assert len(sends) == run.forward_messages(size, q, k, k, **kw)


@pytest.mark.parametrize("size", range(1, 6))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", [m for m in TWO_WAY_MASKS if "options" not in m], ids=str)
@pytest.mark.parametrize("strategy", ("ring", "allgather"))
def test_the_other_strategies_forward_reads_each_needed_block_once(size, layout, mask, strategy):
    """The same replay for ring's two messages a step and for the all-gather (its k-th call on
    every rank delivers every rank's bytes, in rank order)."""
    from tests.mpi.bodies import dense_keep
    schedules = schedule.prove("forward", size, layout=layout, strategy=strategy, **mask)
    rows = _rows(layout, size)
    window = mask.get("window_size", (-1, -1))
    kept = _kept_pairs(rows, lambda qpos, kpos: dense_keep(qpos, kpos, mask["causal"], window))
    for r, read in enumerate(schedule.forward_blocks_read(schedules)):
        needed = [(j, kept[r][j]) for j in range(size) if kept[r][j]]
        assert sorted(read) == needed, (r, read, needed)


def test_a_window_of_half_a_shard_sends_one_block_to_each_neighbour():
    """Non-causal, half a shard each side, contiguous shards, 4 ranks: each block is needed by
    its neighbours only and goes one hop each way, so a middle rank sends 2x its K+V and an end
    rank 1x (one way round, the end ranks sent 3x: a left neighbour is G-1 hops away)."""
    b, s, h, hkv, d = schedule.SHAPE
    kv = 2 * b * s * hkv * d * np.dtype(np.float16).itemsize      # one rank's K and V
    schedules = schedule.prove("forward", 4, causal=False, layout="contiguous",
                               window_size=(s // 2, s // 2))
    sent = [[(a.peer, a.nbytes) for a in recorded.actions if a.kind == "send"] for recorded in schedules]
    assert sent == [[(1, kv)], [(2, kv), (0, kv)], [(3, kv), (1, kv)], [(2, kv)]]
    q, k = np.empty((b, s, h, d), np.float16), np.empty((b, s, hkv, d), np.float16)
    assert [burst.forward_bytes(4, q, k, k, rank=r, window_size=(s // 2, s // 2)) for r in range(4)] == \
        [kv, 2 * kv, 2 * kv, kv]
    assert [[owner for owner, _ in steps] for steps in schedule.forward_blocks_read(schedules)] == \
        [[0, 1], [1, 0, 2], [2, 1, 3], [3, 2]]


def test_full_attention_both_ways_halves_the_exchanges():
    """bidirectional=True without a mask: block j goes ceil((G-1)/2) hops forwards and
    floor((G-1)/2) backwards; a rank sends G-1 blocks in ceil((G-1)/2) exchanges."""
    from burstcu.layout import as_partition
    for size in range(1, 9):
        part = as_partition("contiguous", size, 4)
        assert {burst.kv_hops(j, part, False, bidirectional=True) for j in range(size)} == \
            {(size // 2, (size - 1) // 2)}
        schedules = schedule.prove("forward", size, causal=False, layout="zigzag",
                                   options={"bidirectional": True})
        for recorded in schedules:
            groups = {a.group for a in recorded.actions if a.kind in ("send", "recv")}
            assert len(groups) == size // 2
            assert sum(a.kind == "send" for a in recorded.actions) == size - 1


def test_the_replay_catches_a_block_that_never_arrives():
    """A receive dropped from one rank's recorded schedule: the step after it reads bytes of no
    block (or the replay stops), which `forward_blocks_read` reports."""
    schedules = schedule.record_world("forward", 4, causal=False, layout="contiguous",
                                      window_size=(2, 2))
    for recv in [a for a in schedules[1].actions if a.kind == "recv"]:
        edited = list(schedules)
        edited[1] = schedule.drop_action(schedules[1], recv.index)
        with pytest.raises(schedule.ScheduleError, match="whole and in order|not one block's|stuck"):
            schedule.forward_blocks_read(edited)


# -- following the bytes of a backward: every gradient term summed once, in the right place ---

BACKWARD_MASKS = [dict(causal=False), dict(causal=True), dict(causal=False, window_size=(2, 2)),
                  dict(causal=True, window_size=(3, 0)), dict(causal=False, window_size=(-1, 1)),
                  dict(causal=True, row_sums=True), dict(causal=False, options={"bidirectional": True}),
                  dict(causal=False, window_size=(2, 2), options={"bidirectional": True})]


def _expected_sums(rows: list, keep) -> list[tuple]:
    """For each rank r, the gradient terms its dq, dk and dv sum, each once: a term (i, j,
    kept) for queries of rank i over keys of rank j, kept the (local query row, local key row)
    pairs the mask keeps; dq sums the terms (r, j) of the keys its queries see, dk and dv the
    terms (i, r) of the queries that see its keys. rows, keep: as `_kept_pairs` takes them."""
    size = len(rows)
    kept = _kept_pairs(rows, keep)
    return [(tuple((r, j, kept[r][j]) for j in range(size) if kept[r][j]),)
            + 2 * (tuple((i, r, kept[i][r]) for i in range(size) if kept[i][r]),) for r in range(size)]


@pytest.mark.parametrize("size", range(1, 6))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strategy,mask", [(strategy, mask) for strategy in ("burst", "ring", "allgather")
                                           for mask in BACKWARD_MASKS
                                           if strategy == "burst" or "options" not in mask], ids=str)
def test_backward_sums_each_needed_pair_once(size, layout, strategy, mask):
    """Replaying the recorded NCCL backward of every rank with each rank's inputs labelled and
    each backward_step adding its (query rank, key rank) pair to the sums it writes
    (`schedule.backward_sums`): each rank's dq sums the pairs of the keys its queries see, its
    dk and dv those of the queries that see its keys (written out here over positions,
    `bodies.dense_keep`), each once, wherever the sums travelled."""
    from tests.mpi.bodies import dense_keep
    mask = dict(mask)
    options = mask.pop("options", None)
    schedules = schedule.prove("backward", size, layout=layout, strategy=strategy, options=options, **mask)
    rows = _rows(layout, size)
    window = mask.get("window_size", (-1, -1))
    expected = _expected_sums(rows, lambda qpos, kpos: dense_keep(qpos, kpos, mask["causal"], window))
    if mask.get("row_sums"):        # a row's sums of P: over the keys its dq's are
        expected = [e + e[:1] for e in expected]
    assert schedule.backward_sums(schedules) == expected


@pytest.mark.parametrize("strategy", ("burst", "ring", "allgather"))
def test_two_batch_rows_read_and_sum_as_one(strategy):
    """At B = 2 (a block's rows two runs of bytes, one a batch row) the forward's steps read,
    and the backward's sums hold, what they do at B = 1: each needed block once, each needed
    gradient term once, at its owner."""
    from tests.mpi.bodies import dense_keep
    size, shape = 3, (2,) + schedule.SHAPE[1:]
    rows = _rows("zigzag", size)
    kept = _kept_pairs(rows, lambda qpos, kpos: dense_keep(qpos, kpos, True, (-1, -1)))
    forward = schedule.prove("forward", size, causal=True, layout="zigzag", strategy=strategy, shape=shape)
    assert [sorted(read) for read in schedule.forward_blocks_read(forward)] == \
        [[(j, kept[r][j]) for j in range(size) if kept[r][j]] for r in range(size)]
    backward = schedule.prove("backward", size, causal=True, layout="zigzag", strategy=strategy, shape=shape)
    assert schedule.backward_sums(backward) == _expected_sums(
        rows, lambda qpos, kpos: dense_keep(qpos, kpos, True, (-1, -1)))


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("strategy", ("burst", "ring", "allgather"))
def test_backward_sums_with_documents_block_masks_and_uneven_shards(size, strategy):
    """The same over documents (contiguous shards, cut per-document zigzag, held whole), uneven
    contiguous shards, and a block mask."""
    from tests.mpi.bodies import block_mask_of, dense_keep
    n = schedule.SHAPE[1] * size
    rects = [(0, n // 2, 0, n // 2, "causal"), (n // 2, n, 1, 3, "full"), (n - 1, n, 0, 1, "inverse_causal")]
    block_mask = block_mask_of(rects)
    docs = (0, 3, n // 2 + 1, n)
    cases = [("contiguous", dict(causal=True, cu_seqlens=docs), dict(causal=True, docs=docs)),
             ("zigzag", dict(causal=False, block_mask=block_mask), dict(causal=False, rects=rects))]
    cases += [(part, dict(causal=True, cu_seqlens=cu), dict(causal=True, docs=cu))
              for part, cu in _uneven_partitions(size)]
    for layout, masks, dense in cases:
        schedules = schedule.prove("backward", size, layout=layout, strategy=strategy, **masks)
        rows = _rows(layout, size)
        assert schedule.backward_sums(schedules) == _expected_sums(
            rows, lambda qpos, kpos: dense_keep(qpos, kpos, **dense)), layout


@pytest.mark.parametrize("size", (1, 2, 3))
@pytest.mark.parametrize("strategy", ("burst", "ring", "allgather"))
def test_backward_sums_of_a_call_after_others_hold_that_call_alone(size, strategy):
    """Three backward calls in a row on one op (burst reuses its kept buffers): what the last
    returns, row sums included, sums that call's terms only, each once."""
    from tests.mpi.bodies import dense_keep
    schedules = schedule.prove("backward", size, causal=True, layout="zigzag", strategy=strategy,
                               row_sums=True, calls=3)
    rows = _rows("zigzag", size)
    expected = _expected_sums(rows, lambda qpos, kpos: dense_keep(qpos, kpos, True))
    assert schedule.backward_sums(schedules) == [e + e[:1] for e in expected]


def test_the_backward_replay_catches_a_sum_folded_twice_or_dropped(monkeypatch):
    """Seeded mistakes in the ring strategy's backward: each step's partial dK, dV added twice
    into the sums that travel, or every step restarting them from zero (dropping what earlier
    holders added)."""
    fold = ring._fold
    rows = _rows("contiguous", 3)
    expected = _expected_sums(rows, lambda qpos, kpos: np.ones((len(qpos), len(kpos)), bool))
    for seeded in (lambda ops, dk, dv, parts, first: [fold(ops, dk, dv, parts, first) for _ in range(2)],
                   lambda ops, dk, dv, parts, first: fold(ops, dk, dv, parts, True)):
        monkeypatch.setattr(ring, "_fold", seeded)
        schedules = schedule.prove("backward", 3, causal=False, layout="contiguous", strategy="ring")
        sums = schedule.backward_sums(schedules)
        assert [s[0] for s in sums] == [e[0] for e in expected]       # dq is not ring's to carry
        assert all(s[1] != e[1] and s[2] != e[2] for s, e in zip(sums, expected))


@pytest.mark.parametrize("strategy", ("burst", "ring", "allgather"))
def test_the_backward_replay_catches_a_receive_into_the_wrong_buffer(strategy):
    """A receive landing in the buffer its step sends from (`receive_into_current`), at any
    exchange of one rank: a kernel then reads one rank's queries beside another's, a context or
    sum where none was written, or a returned array sums the wrong pairs."""
    schedules = schedule.record_world("backward", 3, causal=False, layout="contiguous", strategy=strategy)
    good = schedule.backward_sums(schedules)
    for group in sorted({a.group for a in schedules[1].actions if a.kind == "recv"}):
        edited = list(schedules)
        edited[1] = schedule.receive_into_current(schedules[1], group)
        try:
            assert schedule.backward_sums(edited) != good, f"group {group}"
        except schedule.ScheduleError as caught:
            assert re.search(r"reads .* not one|together|not one sum|-byte message", str(caught)), str(caught)


def _burst_step_reading_dout_as_q(monkeypatch):
    step = schedule.RecordingOps.backward_step
    monkeypatch.setattr(schedule.RecordingOps, "backward_step",
                        lambda self, ctx, q, dout, *rest, **kw: step(self, ctx, dout, q, *rest, **kw))


def _ring_folding_dv_into_dk(monkeypatch):
    fold = ring._fold
    monkeypatch.setattr(ring, "_fold", lambda ops, dk, dv, parts, first: fold(
        ops, dk, dv, None if parts is None else parts[::-1], first))


def _allgather_returning_dv_as_dk(monkeypatch):
    from burstcu.engine import allgather
    scatter = allgather._reduce_scatter

    def swapped(*args):
        mine = scatter(*args)
        mine.fields["dk"], mine.fields["dv"] = mine.fields["dv"], mine.fields["dk"]
        return mine
    monkeypatch.setattr(allgather, "_reduce_scatter", swapped)


def _burst_masking_keys_as_queries(monkeypatch):
    blocks = burst.mask_blocks
    monkeypatch.setattr(burst, "mask_blocks", lambda part, q_rank, kv_rank, *rest: blocks(part, kv_rank,
                                                                                          q_rank, *rest))


def _a_cast_that_broadcasts_one_row(monkeypatch):
    def cast_copy(ops, x, dtype):
        y = ops.zeros(x.shape, dtype)
        ops.copy_(y, x[:, :1])
        return y
    for module in (burst, ring):
        monkeypatch.setattr(module, "cast_copy", cast_copy)


@pytest.mark.parametrize("strategy,seed", [("burst", _burst_step_reading_dout_as_q),
                                           ("ring", _ring_folding_dv_into_dk),
                                           ("allgather", _allgather_returning_dv_as_dk),
                                           ("burst", _burst_masking_keys_as_queries),
                                           ("burst", _a_cast_that_broadcasts_one_row),
                                           ("ring", _a_cast_that_broadcasts_one_row)],
                         ids=lambda x: getattr(x, "__name__", x))
def test_the_backward_replay_tells_the_tensors_and_rows_apart(monkeypatch, strategy, seed):
    """Seeded mistakes that keep every (query rank, key rank) pair in place: dout read where q
    is, dV folded into the dK that travels, dV returned as dK, a step masked with its query and
    key ranks swapped, a cast that copies one row to all. Each is reported, or changes a sum."""
    from tests.mpi.bodies import dense_keep
    seed(monkeypatch)
    rows = _rows("zigzag", 3)
    expected = _expected_sums(rows, lambda qpos, kpos: dense_keep(qpos, kpos, True))
    schedules = schedule.prove("backward", 3, causal=True, layout="zigzag", strategy=strategy)
    try:
        assert schedule.backward_sums(schedules) != expected
    except schedule.ScheduleError as caught:
        assert re.search(r"not one|together", str(caught)), str(caught)


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("calls", (1, 3))
def test_decode_merges_every_ranks_partial_of_this_call(size, calls):
    """Replaying decode: every rank's merge of call n reads, in rank order, the partial each
    rank wrote in its call n, whatever its cache length."""
    schedules = [schedule.record_decode(size, r, calls=calls, cache_rows=3 + r) for r in range(size)]
    schedule.proved(schedules)
    want = [[tuple(("partial", field, j, n) for field in ("acc", "m", "l")) for j in range(size)]
            for n in range(calls)]
    assert schedule.decode_parts_merged(schedules) == [want] * size


def test_the_decode_replay_catches_a_stale_or_wrong_partial(monkeypatch):
    """Seeded mistakes: the all-gather issued before the partial it should carry (race-free,
    but every rank merges the last call's partials, or nothing), a merge that reads this
    rank's own partial for every rank, and one that reads each part's l as its m."""
    from burstcu.engine import decode

    def gather_first(q, k_cache, v_cache, lengths, scale, ops, transport):
        packed = decode.packed_partials(q, ops, transport.size)
        parts = decode.gathered_partials(packed, ops, transport)
        ops.decode_partial(q, k_cache, v_cache, lengths, scale, out=(packed["acc"], packed["m"], packed["l"]))
        return ops.decode_merge(parts, q.dtype)

    def own_only(packed, ops, transport):
        parts = gathered(packed, ops, transport)
        return [parts[transport.rank]] * transport.size

    def m_for_l(packed, ops, transport):
        return [(acc, l, m) for acc, m, l in gathered(packed, ops, transport)]

    gathered = decode.gathered_partials
    want = [[tuple(("partial", field, j, n) for field in ("acc", "m", "l")) for j in range(3)]
            for n in range(2)]
    for module, name, seeded in ((decode, "decode", gather_first), (decode, "gathered_partials", own_only),
                                 (decode, "gathered_partials", m_for_l)):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, seeded)
            schedules = schedule.proved([schedule.record_decode(3, r, calls=2) for r in range(3)])
            assert all(merged != want for merged in schedule.decode_parts_merged(schedules)), name


@pytest.mark.parametrize("size", (2, 3, 4))
@pytest.mark.parametrize("pass_", PASSES)
def test_ulysses_schedule_with_uneven_shards_and_calls_in_a_row_is_race_free(size, pass_):
    """Ulysses over shards of different lengths (its all-to-alls move pieces of other sizes),
    three calls in a row."""
    for part, docs in _uneven_partitions(size):
        schedule.prove(pass_, size, causal=True, layout=part, strategy="ulysses", shape=ULYSSES_SHAPE,
                       cu_seqlens=docs, calls=3)


def test_fake_arrays_refuse_what_cupy_refuses_and_add_in_place():
    device = schedule.RecordingDevice()
    x = schedule.RecordingOps(device).new("x", (2, 3), np.float32)
    with pytest.raises(IndexError):
        x[2]
    with pytest.raises(IndexError):
        x[0, -4]
    with pytest.raises(AssertionError):
        x[True]
    y = x[1]
    y += x[0]
    assert y.buffer == x.buffer and device.actions[-1].writes == (x[1].region,)
    assert device.actions[-1].reads == (x[1].region, x[0].region)


def test_the_backward_replay_catches_rows_out_of_place(monkeypatch):
    """A seeded mistake that keeps every tensor and pair in place: burst loads its queries into
    the bundle with the two halves of the rows swapped."""
    load = burst._BundleRing.load

    def swapped_load(self, dout, out, lse, delta):
        load(self, dout, out, lse, delta)
        first, half = self.holding(0), self.q.shape[1] // 2
        self.ops.copy_(first["q"][:, :half], self.q[:, half:])
        self.ops.copy_(first["q"][:, half:], self.q[:, :half])

    monkeypatch.setattr(burst._BundleRing, "load", swapped_load)
    schedules = schedule.prove("backward", 3, causal=True, layout="zigzag")
    with pytest.raises(schedule.ScheduleError, match="not one rank's q whole and in order"):
        schedule.backward_sums(schedules)


def test_between_calls_the_caller_reads_outputs_and_writes_inputs():
    """`between` orders like the caller's work on the compute stream: a receive into an input
    that nothing waits for before the next call is a race with it."""
    device = schedule.RecordingDevice()
    ops = schedule.RecordingOps(device)
    transport = NCCLTransport(0, 2, device)
    k, out = ops.new("k", (4,), np.float32), ops.new("out", (4,), np.float32)
    device.sentinel("begin")
    transport.send_recv(None, k, 1, 1)
    transport.commit()
    device.between([out], [k])
    text = schedule.report(schedule.check(schedule.Schedule(0, 2, device.actions, device.buffers)))
    assert "write-after-write race on buffer 'k'" in text and "between calls" in text
    transport.wait()
    device.between([out], [k])
    recorded = schedule.Schedule(0, 2, device.actions, device.buffers)
    assert len(schedule.check(recorded)) == 1   # the first `between` only


# -- following the bytes of linear attention: every chunk's state where it belongs ---------------

def _expected_linear(pass_: str, causal: bool, chunks: list[list[tuple]]) -> list[tuple]:
    """For each rank, what each row of what linear attention returns sums (`schedule.linear_sums`
    states the terms). chunks[r]: rank r's chunks, (first local row, rows, first global
    position) each. Causal: a row of chunk t sums its own chunk's run ("intra"), its rows'
    product ("rows") with the states M of every chunk before t (out, dq) or dM of every chunk
    after t (dk, dv); not causal: the product of all its rows with every chunk's state."""
    every = [((r, a, n), pos) for r, mine in enumerate(chunks) for a, n, pos in mine]
    result = []
    for r, mine in enumerate(chunks):
        seqlen = sum(n for _, n, _ in mine)
        kinds = ("M",) if pass_ == "forward" else ("M", "dM", "dM")
        arrays = []
        for kind in kinds:
            rows = []
            for a, n, pos in mine:
                if causal:
                    seen = [c for c, p in every if (p < pos if kind == "M" else p > pos)]
                    terms = [("intra", (r, a, n)), ("rows", (r, a, n))]
                else:
                    seen, terms = [c for c, _ in every], [("rows", (r, 0, seqlen))]
                rows += [tuple(sorted(terms + [(kind, c) for c in seen]))] * n
            arrays.append(rows)
        result.append(tuple(arrays))
    return result


def _linear_chunks(layout, size: int, seqlen: int) -> list[list[tuple]]:
    """Every rank's chunks (first local row, rows, first global position), written out: one
    contiguous run, or zigzag's two pieces r and 2G-1-r; a list of lengths: contiguous shards
    of those lengths."""
    if not isinstance(layout, str):
        starts = np.cumsum([0] + list(layout))
        return [[(0, n, int(starts[r]))] for r, n in enumerate(layout)]
    if layout == "contiguous":
        return [[(0, seqlen, r * seqlen)] for r in range(size)]
    c = seqlen // 2
    return [[(0, c, r * c), (c, c, (2 * size - 1 - r) * c)] for r in range(size)]


@pytest.mark.parametrize("size", (1, 2, 3, 5))
@pytest.mark.parametrize("pass_", PASSES)
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("layout", LAYOUTS + ((2, 5, 1, 4, 3),))
@pytest.mark.parametrize("strategy", engine.LINEAR_NAMES)
def test_linear_attention_sums_every_chunks_state_where_it_belongs(size, pass_, causal, layout, strategy):
    """Replaying LASP-1's chains and LASP-2's all-gather on every rank: each row of what a rank
    returns sums exactly the states of the chunks before its own (causal out, dq) or after it
    (dk, dv), or every chunk's (not causal), through its own rows."""
    from burstcu.layout import partition
    if not isinstance(layout, str):
        layout = layout[:size]
        part = partition("contiguous", size, sum(layout), lengths=layout)
    seqlen = schedule.SHAPE[1]
    schedules = schedule.prove(pass_, size, causal=causal, strategy=strategy,
                               layout=layout if isinstance(layout, str) else part)
    chunks = _linear_chunks(layout, size, seqlen)
    got = schedule.linear_sums(schedules, [sum(n for _, n, _ in mine) for mine in chunks])
    assert got == _expected_linear(pass_, causal, chunks)


def _lasp2_prefix_with_its_own_chunk(monkeypatch):
    from burstcu.engine import lasp2
    total = lasp2._total
    monkeypatch.setattr(lasp2, "_total", lambda ops, states, *rest: total(
        ops, list(states) + list(states[-1:]), *rest))


def _lasp2_without_its_own_state(monkeypatch):
    from burstcu.engine import lasp2
    gather = lasp2._gather

    def gathered(ops, transport, mine, label):
        out, posted = gather(ops, transport, mine, label)
        ops.copy_(out[transport.rank], 0)
        return out, posted
    monkeypatch.setattr(lasp2, "_gather", gathered)


def _lasp1_sending_zeros(monkeypatch):
    from burstcu.engine import lasp1
    send = lasp1._Chain.send
    monkeypatch.setattr(lasp1._Chain, "send", lambda self, buf, dst, label: send(
        self, buf, dst, label) if "total" in label else send(self, self.ops.zeros(buf.shape, buf.dtype),
                                                            dst, label))


def _lasp2_first_state_of_every_value_row(monkeypatch):
    state = schedule.RecordingOps.linear_kv_state
    monkeypatch.setattr(schedule.RecordingOps, "linear_kv_state",
                        lambda self, k, v, acc: state(self, k, _whole_rows_of(v), acc))


def _whole_rows_of(x):
    """The whole (B, S, ...) array a row slice `x` of it was cut from (its buffer from byte 0)."""
    return schedule.FakeArray(x.buffer, 0, (x.shape[0], schedule.SHAPE[1]) + x.shape[2:], x.dtype,
                              allocation=x.allocation)


@pytest.mark.parametrize("strategy,seed", [("lasp2", _lasp2_prefix_with_its_own_chunk),
                                           ("lasp2", _lasp2_without_its_own_state),
                                           ("lasp2", _lasp2_first_state_of_every_value_row),
                                           ("lasp1", _lasp1_sending_zeros)],
                         ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("pass_", PASSES)
def test_the_linear_replay_catches_a_state_too_many_or_missing(monkeypatch, strategy, seed, pass_):
    """Seeded mistakes: LASP-2 summing a chunk's state twice (its prefixes and totals end with
    the last state again), leaving out its own state from the gather, or making each chunk's
    state of its keys' rows with all of V, and LASP-1 sending zeros along its chain instead of
    the running sum. Each is reported, or changes a sum."""
    seed(monkeypatch)
    schedules = schedule.prove(pass_, 3, causal=True, layout="zigzag", strategy=strategy)
    chunks = _linear_chunks("zigzag", 3, schedule.SHAPE[1])
    try:
        got = schedule.linear_sums(schedules, [schedule.SHAPE[1]] * 3)
        assert got != _expected_linear(pass_, True, chunks)
    except schedule.ScheduleError as caught:
        assert "rows" in str(caught), str(caught)


def test_the_linear_replay_refuses_strided_rows():
    """With B > 1 a chunk's rows are one run of bytes per batch row, which the linear
    replay's chunk (one run of rows) cannot say: it says so, rather than sum the wrong chunks
    (the bounding span of the strided rows would read as one run of other rows)."""
    schedules = schedule.prove("forward", 2, causal=True, layout="zigzag", strategy="lasp2",
                               shape=(2,) + schedule.SHAPE[1:])
    with pytest.raises(schedule.ScheduleError, match="not rows of one rank's|not one sum"):
        schedule.linear_sums(schedules, [schedule.SHAPE[1]] * 2)


@pytest.mark.parametrize("chunk", range(2))
def test_random_masks_and_shards_schedules_are_race_free(chunk):
    """40 problems a chunk of tests/test_randomized.py's draw (`masked_problem`: windows,
    documents with or without a window, block masks of random kinds, uneven shards, each layout;
    1-4 ranks) over the strategies NCCL runs alone (burst, ring, allgather): every rank's
    forward and backward (with and without check=True's row sums) proved free of races and
    deadlocks, each rank sending what its strategy's formulas count."""
    from burstcu.layout import partition
    from tests.mpi.bodies import block_mask_of
    from tests.test_randomized import masked_problem

    for seed in range(40 * chunk, 40 * chunk + 40):
        p = masked_problem(seed)
        size, strategy, n = p["ranks"], RINGS[seed % 2] if seed % 3 else "allgather", p["n"]
        part = (partition("contiguous", size, n, lengths=tuple(p["lengths"])) if p["lengths"] else
                partition(p["layout"], size, n, None if p["docs"] is None else tuple(p["docs"])))
        if p["rects"] is not None:
            mask = dict(causal=False, block_mask=block_mask_of(p["rects"]))
        else:
            mask = dict(causal=p["causal"], window_size=p["window"],
                        cu_seqlens=None if p["docs"] is None else tuple(p["docs"]))
        for pass_, row_sums in (("forward", False), ("backward", False), ("backward", True)):
            shapes = [(1, part.lengths[r], 2, 1, 8) for r in range(size)]
            schedules = schedule.proved([
                schedule.record(pass_, size, r, layout=part, shape=shapes[r], strategy=strategy,
                                **mask, **({"row_sums": True} if row_sums else {}))
                for r in range(size)])
            if not row_sums:
                for r, recorded in enumerate(schedules):
                    assert _sent(recorded) == _counted(strategy, pass_, size, r, shapes[r],
                                                       layout=part, **mask), (seed, p, r)
