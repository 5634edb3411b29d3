"""Overlap efficiency of the ring schedules, with the baselines measured in the same run.

    mpiexec -bind-to core -n G python bench/cpu/overlap.py [--seqlen N ...] [--heads H] [--headdim D]
        [--causal] [--strategies burst ring allgather ulysses usp] [--repeats R] [--json FILE]
        [--plot FILE] [--link-gbps X [--link-latency-us Y]] [--allow-unbound]

Each rank runs on a core of its own: unbound, the scheduler moves the ranks about and a step's
compute varied by up to 40% between repeats here (2 ranks on 2 cores, N = 2048: 106-167 ms
unbound, 102-109 ms bound). Launched bound (MPICH: -bind-to core; Open MPI: --bind-to core), the
launcher's binding stands; launched unbound, the script binds every thread of each rank to the
node-local-rank-th core (os.sched_setaffinity; the node-local rank from a shared-memory split of
the communicator) with BLAS limited to that core, when the node has at least as many cores as
ranks. Where it can do neither it refuses to time, saying how to launch (--allow-unbound times
anyway). The header line and the JSON's environment.binding say which it was.

For every configuration (global seqlen x strategy) the real engine runs three times per repeat:

  compute-only   ops as usual, transport replaced by one that moves nothing (the receive buffer
                 gets a local copy of the send buffer at post time, so values stay finite);
  comm-only      transport as usual, ops whose steps are given no blocks (no attention math; the
                 O(S*D) layout conversions around a step remain);
  overlapped     both real: what a user runs.

Per ring step, from the `burstcu.engine.Trace` the engine records (plus the host time spent posting
the step's exchange, measured by a pass-through transport wrapper):

  t_compute    = compute_s of the step in the compute-only run
  t_comm       = post to completion of the step's exchanges in the comm-only run (completion:
                 when the transport's progress thread finished them, or the end of a blocking
                 all-gather): the exchange's own time; 0 for a step that exchanges nothing
  t_overlapped = post + compute + wait of the step in the overlapped run
  efficiency   = (t_compute + t_comm - t_overlapped) / t_comm: the fraction of the exchange's
                 time hidden behind compute. 1: fully hidden; 0: compute and exchange ran back
                 to back; at most t_compute / t_comm when the exchange is the longer (it cannot
                 all hide); < 0: running them together was slower than back to back (contention
                 for cores or memory bandwidth); undefined (null) without an exchange.

Per pass (forward, backward), the same formula over the sums of the steps. Per-step figures are
medians over repeats. Every efficiency carries its uncertainty: the spreads over repeats
(interquartile range, half the range with 2 or 3 repeats) of t_compute, t_comm and t_overlapped
(per step, or of the pass sums) carried through the formula to first order,

  uncertainty  = (s_compute + s_overlapped + |t_compute - t_overlapped| / t_comm * s_comm) / t_comm

and it is reported only when that is below 0.15 (MEASURABLE): else the line says "not measurable
here (±X from the spread over R repeats, ...)" and the JSON holds efficiency null beside
efficiency_raw and efficiency_uncertainty; a negative one is printed with what it means. On a CPU
the exchange through shared memory takes about a millisecond, less than compute jitter: emulate
a link (below). End-to-end forward and forward+backward wall times (overlapped run) are the max
over ranks, median over repeats. For "allgather" the blocking gather is step 0's wait and the
reduce-scatter hops are steps G.. of the backward pass: its efficiency is the no-overlap baseline.

--link-gbps X [--link-latency-us Y] runs over `burstcu.Link(gbps=X, latency_us=Y)`: the MPI
transport paces every message as an X Gb/s link with Y us per message would (its progress thread
sleeps until then, beside the compute), so t_comm is the link's, not shared memory's. Every
figure that depends on it is labelled "emulated link X Gb/s, Y us", and each pass gets
efficiency_predicted: bench/model/predict.py's `overlap_prediction` from this run's measured
per-step t_compute and each step's messages and bytes on the link (t_comm = messages * latency +
bytes * 8 / rate per direction; t_overlapped = max(t_compute, t_comm), or their sum for a
blocking exchange: allgather's gather and hops).

Rank 0 prints one line per configuration, then a table of every pass (--json: every figure of
every rank, gathered to rank 0); --plot draws a per-rank timeline of compute and communication
(overlapped run, largest seqlen, first strategy; forward and backward marked) and efficiency
against seqlen with its uncertainty as error bars (with a link: the prediction beside it, and
measured against predicted). On the CPU backend these are CPU + MPI figures (BLAS on the main
thread, transfers on the transport's progress thread), never GPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.model.predict import overlap_prediction  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine import Trace  # noqa: E402
from burstcu.transport.base import Transport  # noqa: E402
from burstcu.transport.link import Link  # noqa: E402

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: BLAS then keeps its own thread count after binding
    threadpool_limits = None

MODES = ("compute", "comm", "overlapped")
PASSES = ("forward", "backward")
# strategies whose exchange completes before the compute that follows it (burstcu.engine.allgather:
# "No overlap: the gather is blocking, by design of the baseline"): the model hides nothing there
BLOCKING = {"allgather"}
TRAFFIC = ("sent_messages", "sent_bytes", "received_messages", "received_bytes")
TIMES = ("t_compute", "t_comm", "t_overlapped")   # what MODES measure, in that order
# the largest uncertainty (from the spread over repeats) at which an efficiency is printed
MEASURABLE = 0.15


# ----------------------------------------------------------------------------------------------
# wrappers: the real engine runs through these in every mode


class TimedTransport(Transport):
    """Pass-through (`null=False`) or do-nothing (`null=True`) transport that timestamps posts.

    It records, per commit, [post start, completion] (completion: when the progress thread's
    Waitall returned if the wrapped MPI transport has one, else the end of `wait`), the host
    seconds spent posting since the last step and what the posts move (`take_post`), and every
    all-gather's interval.
    """

    def __init__(self, inner: Transport, null: bool):
        super().__init__(inner.rank, inner.size)
        self.inner, self.null = inner, null
        self.name = f"{'null' if null else 'timed'}({inner.name})"
        if not null:
            self.stats = inner.stats
        self.intervals: list = []   # [kind, start, end]
        self._open: list = []       # intervals whose completion is not yet known
        self._step: list = []       # the intervals of the exchanges since the last step
        self._post_s, self._posts = 0.0, 0
        self._traffic = dict.fromkeys(TRAFFIC, 0)
        self.root = self            # sub-groups (USP) keep their records in the top wrapper

    # ring pattern
    def send_recv(self, send_buf, recv_buf, dst, src):
        if self.null:
            super().send_recv(send_buf, recv_buf, dst, src)
        else:
            self.inner.send_recv(send_buf, recv_buf, dst, src)

    def _count(self, sent: list, received: list) -> None:
        t = self.root._traffic
        t["sent_messages"] += len(sent)
        t["sent_bytes"] += sum(sent)
        t["received_messages"] += len(received)
        t["received_bytes"] += sum(received)

    def commit(self):
        queued = self._queued if self.null else self.inner._queued
        self._count([x.nbytes for x, _, _, _ in queued if x is not None],
                    [y.nbytes for _, y, _, _ in queued if y is not None])
        t0 = time.perf_counter()
        if self.null:
            super().commit()
        else:
            self.inner.commit()
        t1 = time.perf_counter()
        root = self.root
        root._post_s += t1 - t0
        root._posts += 1
        iv = ["comm", t0, None]
        root.intervals.append(iv)
        root._open.append(iv)
        root._step.append(iv)
        pending = getattr(self.inner, "_pending", None)  # bench-only peek at the MPI thread's futures
        if not self.null and pending:
            pending[-1].add_done_callback(lambda _f, iv=iv: iv.__setitem__(2, time.perf_counter()))

    def wait(self):
        if self.null:
            super().wait()
        else:
            self.inner.wait()
        now = time.perf_counter()
        for iv in self.root._open:
            if iv[2] is None:
                iv[2] = now
        self.root._open = []

    def _post(self, exchanges):  # null mode only: a local copy instead of a transfer
        for send_buf, recv_buf, _, _ in exchanges:
            if send_buf is not None and recv_buf is not None and send_buf.nbytes == recv_buf.nbytes:
                recv_buf[...] = send_buf

    def _wait(self):
        pass

    def take_post(self) -> tuple[float, int, dict]:
        """(host seconds posting, number of posts + all-gathers, messages and bytes they move
        on this rank and comm_s, the seconds from post to completion of each, added) since the
        last call. Called after the step's wait, so every exchange of the step has completed."""
        comm_s = _covered([(a, b) for _, a, b in self._step if b is not None])
        out = (self._post_s, self._posts, {**self._traffic, "comm_s": comm_s})
        self._post_s, self._posts, self._traffic, self._step = 0.0, 0, dict.fromkeys(TRAFFIC, 0), []
        return out

    # collectives
    def allgather(self, send_buf, recv_buf):
        t0 = time.perf_counter()
        if self.null:
            for j in range(self.size):
                recv_buf[j] = send_buf
        else:
            self.inner.allgather(send_buf, recv_buf)
        iv = ["comm", t0, time.perf_counter()]
        self.root.intervals.append(iv)
        if self.size > 1:  # a group of one gathers by a local copy: not communication
            self.root._posts += 1
            self.root._step.append(iv)
        pieces = [send_buf.nbytes] * (self.size - 1)   # G-1 messages each way (CommStats)
        self._count(pieces, pieces)

    def allgather_object(self, obj, what="metadata"):
        self.inner.call, self.inner.where = self.call, self.where
        return self.inner.allgather_object(obj, what)

    def _abort(self, reason):
        self.inner._abort(reason)

    def barrier(self):
        self.inner.barrier()

    def _split(self, color, key, members, name):
        """USP's sub-groups: the wrapped transport's, wrapped alike; their posts and intervals
        are recorded in the top wrapper, so a step's timeline shows every group's traffic."""
        sub = TimedTransport(self.inner.split(color, key, name), self.null)
        sub.root = self.root
        return sub


def _covered(intervals: list) -> float:
    """Seconds covered by the union of (start, end) intervals (exchanges of one step may run
    one after another or at once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class TimedOps(C.StepTimingOps):
    """`StepTimingOps` on the host clock: ["compute", start, stop] a step."""

    def timed(self, fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        self.intervals.append(["compute", t0, time.perf_counter()])


class StepRecorder(Trace):
    """A `Trace` that also notes, per step, the posting time, post count and traffic since the
    last step."""

    def __init__(self, transport: TimedTransport):
        super().__init__()
        self.transport = transport
        self.extra: list = []

    def add(self, *args) -> None:
        super().add(*args)
        self.extra.append(self.transport.take_post())


# ----------------------------------------------------------------------------------------------
# binding: each rank on a core of its own, or no timings


def physical_cores(cpus) -> list[tuple[int, ...]]:
    """The logical CPUs in `cpus` grouped by physical core (hyperthreads of one core together,
    from /sys/devices/system/cpu/cpuN/topology/thread_siblings_list; each CPU alone where that
    is unreadable), ordered by their first CPU."""
    cpus, cores = set(cpus), set()
    for cpu in cpus:
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            siblings = _cpu_list(text) & cpus
        except (OSError, ValueError):
            siblings = {cpu}
        cores.add(tuple(sorted(siblings or {cpu})))
    return sorted(cores)


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list such as "0-3,8,10-11"."""
    out = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def core_for_rank(cores: list, local_rank: int, local_size: int):
    """The core node-local rank `local_rank` of `local_size` binds to: the local_rank-th of the
    `cores` the ranks share (as `physical_cores` lists them), or None when there are fewer cores
    than ranks on the node (ranks would share a core: binding cannot help)."""
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not one of {local_size} ranks")
    return cores[local_rank] if len(cores) >= local_size else None


def bound_by_launcher(affinities: list) -> bool:
    """Whether the node-local ranks, whose CPU sets are `affinities` (one per rank), already run
    on CPUs of their own: more than one rank and no CPU in two sets (`mpiexec -bind-to core`,
    `taskset` per rank)."""
    sets = [set(a) for a in affinities]
    return len(sets) > 1 and sum(map(len, sets)) == len(set().union(*sets))


def bind_ranks(comm, allow_unbound: bool) -> dict:
    """Bind every thread of this rank to a core of its own unless the launcher has; collective.

    The node-local rank comes from a shared-memory split of `comm`; the ranks of a node that
    share one CPU set bind to its cores in local-rank order (`core_for_rank`), with BLAS limited
    to that core's hardware threads, as `-bind-to core` leaves it. Returns the run's binding
    (`binding_summary` of every rank's bound, how, cpus, local_rank, local_size, why). When some
    rank is left unbound, every rank raises SystemExit with how to launch instead, unless
    `allow_unbound`."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    local_rank, affinities = 0, [mine]
    if comm is not None:
        # imported here, as bench._common.world does: importing mpi4py initialises MPI, which a
        # module import (the tests', the plot's) must not; `comm` proves it loads
        from mpi4py import MPI
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        try:
            local_rank, affinities = local.Get_rank(), local.allgather(mine)
        finally:
            local.Free()
    record = {"bound": False, "how": None, "cpus": mine, "local_rank": local_rank,
              "local_size": len(affinities), "why": None}
    cores = None if mine is None else physical_cores(mine)
    core = None if cores is None else core_for_rank(cores, local_rank, len(affinities))
    if mine is None or not hasattr(os, "sched_setaffinity"):
        record["why"] = "this platform has no os.sched_setaffinity"
    elif bound_by_launcher(affinities):
        record.update(bound=True, how="by the launcher")
    elif any(a != mine for a in affinities):
        record["why"] = "the ranks on this node have different, overlapping CPU sets"
    elif core is None:
        record["why"] = f"{len(affinities)} ranks on this node share {len(cores)} core(s)"
    else:
        _set_affinity(core)
        record.update(bound=True, cpus=list(core),
                      how=f"by this script (os.sched_setaffinity, BLAS threads {_limit_blas(len(core))})")
    every = [record] if comm is None else comm.allgather(record)
    unbound = [(rank, r["why"]) for rank, r in enumerate(every) if not r["bound"]]
    if unbound and not allow_unbound:  # every rank leaves; rank 0 says why for all of them
        if comm is not None and comm.Get_rank() != 0:
            raise SystemExit(2)
        why = "; ".join(f"rank {rank}: {text}" for rank, text in unbound)
        raise SystemExit(f"overlap.py: cannot bind every rank to a core of its own ({why}). Unbound, "
                         f"the scheduler moves ranks between cores and the repeats disagree. Launch "
                         f"bound, e.g. mpiexec -bind-to core -n G python bench/cpu/overlap.py ... "
                         f"(Open MPI: --bind-to core), with at least as many cores as ranks per node; "
                         f"or pass --allow-unbound to time anyway.")
    return binding_summary(every)


def _set_affinity(cpus) -> None:
    """Confine every thread of this process (BLAS workers, MPI's) to `cpus`; threads started
    later inherit it."""
    tasks = Path("/proc/self/task")
    for tid in sorted(int(t.name) for t in tasks.iterdir()) if tasks.is_dir() else [0]:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _limit_blas(threads: int) -> str:
    """Limit BLAS/OpenMP pools to `threads` (threadpoolctl); what was done, as text."""
    if threadpool_limits is None:
        return "unchanged: threadpoolctl is not installed"
    threadpool_limits(limits=threads)
    return f"limited to {threads}"


def binding_summary(every: list) -> dict:
    """The run's binding from the records of `bind_ranks` of every rank: bound (all of them), how
    (the distinct ways, or why not) and per_rank."""
    return {"bound": all(r["bound"] for r in every),
            "how": "; ".join(dict.fromkeys(r["how"] or r["why"] for r in every)),
            "per_rank": every}


def binding_line(binding: dict) -> str:
    """One header line: which CPUs each rank runs on and who bound it."""
    cpus = ", ".join(f"rank {rank} -> CPU {','.join(map(str, r['cpus'] or ['?']))}"
                     for rank, r in enumerate(binding["per_rank"]))
    if binding["bound"]:
        return f"# ranks bound to a core each {binding['how']}: {cpus}"
    return (f"# WARNING: ranks NOT bound ({binding['how']}): {cpus}; the scheduler moves them "
            f"and most efficiencies read 'not measurable here'")


# ----------------------------------------------------------------------------------------------
# one configuration


def _run_mode(group, mode: str, strategy: str, inputs, causal: bool, layout: str) -> dict:
    """One forward + backward pass in `mode`; per-step records and pass wall times of this rank."""
    transport = TimedTransport(group.transport, null=(mode == "compute"))
    ops = TimedOps(group.ops, compute=(mode != "comm"))
    rec = StepRecorder(transport)
    g = dataclasses.replace(group, transport=transport, ops=ops, trace=rec)
    q, k, v, dout = inputs
    group.barrier()
    t0 = time.perf_counter()
    out, lse = burstcu.attention(q, k, v, g, causal=causal, layout=layout, return_lse=True,
                                 strategy=strategy)
    t1 = time.perf_counter()
    burstcu.attention_backward(dout, q, k, v, out, lse, g, causal=causal, layout=layout,
                               strategy=strategy)
    t2 = time.perf_counter()
    steps = []
    for st, (post_s, posts, traffic) in zip(rec.steps, rec.extra):
        steps.append({"pass": st.pass_, "step": st.step, "source": st.source_rank, "blocks": st.blocks,
                      "compute_s": st.compute_s, "wait_s": st.wait_s, "post_s": post_s,
                      "exchanged": posts > 0, **traffic})
    timeline = [[kind, a - t0, (b if b is not None else t2) - t0]
                for kind, a, b in ops.intervals + transport.intervals]
    return {"steps": steps, "forward_s": t1 - t0, "fwd_bwd_s": t2 - t0, "timeline": timeline}


def _step_time(mode: str):
    """What a step's record contributes to t_compute, t_comm or t_overlapped (module docstring)."""
    if mode == "compute":
        return lambda s: s["compute_s"]
    if mode == "comm":
        return lambda s: s["comm_s"] if s["exchanged"] else 0.0
    return lambda s: s["post_s"] + s["compute_s"] + s["wait_s"]


def _step_metrics(runs: dict, link: Link | None, blocking: bool) -> dict:
    """Per pass: per-step t_compute, t_comm, t_overlapped (medians over repeats) and efficiency
    with its uncertainty (`efficiency_from_repeats`), and the pass figures (`pass_figures`)."""
    out = {}
    for pass_ in PASSES:
        ovl_steps = [s for s in runs["overlapped"][0]["steps"] if s["pass"] == pass_]
        steps = []
        for i, ovl in enumerate(ovl_steps):
            def repeats(mode):
                f = _step_time(mode)
                return [f([s for s in run["steps"] if s["pass"] == pass_][i]) for run in runs[mode]]
            steps.append({"step": ovl["step"], "source": ovl["source"], "blocks": ovl["blocks"],
                          **efficiency_from_repeats(*(repeats(mode) for mode in MODES)),
                          **{k: ovl[k] for k in TRAFFIC}})
        tc, tm, to = (sum(s[k] for s in steps) for k in TIMES)
        sums = _pass_sums(runs, pass_)
        spreads = {k: spread(xs) for k, xs in sums.items()}
        out[pass_] = {"steps": steps, **pass_figures(tc, tm, to, spreads, len(runs["overlapped"])),
                      "repeats_s": sums, **_predicted(steps, link, blocking)}
    return out


def _predicted(steps: list, link: Link | None, blocking: bool) -> dict:
    """bench/model/predict.py's prediction of the pass over the emulated link from the measured
    compute."""
    if link is None:
        return {}
    pred = overlap_prediction(steps, link, blocking)
    return {"efficiency_predicted": pred["efficiency"], "t_comm_predicted": pred["t_comm"],
            "t_overlapped_predicted": pred["t_overlapped"], "t_hidden_predicted": pred["t_hidden"],
            "comm_hidden_predicted": pred["hidden"], **link.as_dict()}


def _pass_sums(runs: dict, pass_: str) -> dict:
    """Per repeat, the pass sums of t_compute, t_comm and t_overlapped (seconds)."""
    return {name: [sum(_step_time(mode)(s) for s in run["steps"] if s["pass"] == pass_)
                   for run in runs[mode]] for mode, name in zip(MODES, TIMES)}


# ----------------------------------------------------------------------------------------------
# uncertainty: a figure is printed only when the spread over repeats pins it to within 0.15


def spread(xs: list) -> float | None:
    """How far one repeat strays: the interquartile range of the repeat times (half the range
    with 2 or 3 repeats; like the medians it qualifies, it ignores one repeat slowed by another
    process among 5 or more); None with fewer than 2 repeats."""
    if len(xs) < 2:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def efficiency_uncertainty(tc: float, tm: float, to: float, spreads: dict) -> float | None:
    """The spreads of t_compute, t_comm and t_overlapped (`spreads`, keyed as TIMES) carried
    through `C.overlap_efficiency` = 1 + (tc - to) / tm to first order, their magnitudes added
    (the three come from separate runs; the sum bounds them together):

        (s_compute + s_overlapped + |tc - to| / tm * s_comm) / tm

    An exchange mostly hidden (to near tc) is insensitive to the spread of t_comm; one that hides
    nothing is as uncertain as all three. None without an exchange or without a spread."""
    if not tm > 0 or any(spreads.get(k) is None for k in TIMES):
        return None
    s_c, s_m, s_o = (spreads[k] for k in TIMES)
    return (s_c + s_o + abs(tc - to) / tm * s_m) / tm


def pass_figures(tc: float, tm: float, to: float, spreads: dict, repeats: int) -> dict:
    """A pass's (or step's) times, its efficiency when it is a measurement, and what to say
    otherwise.

    efficiency_raw: `C.overlap_efficiency(tc, tm, to)`, whatever the noise;
    efficiency_uncertainty: `efficiency_uncertainty` from `spreads` (the ± printed);
    efficiency: efficiency_raw when that uncertainty is below MEASURABLE, else None (no exchange,
    one repeat, or a figure the repeats do not pin down); note: why it is missing or what a
    negative one means."""
    raw = C.overlap_efficiency(tc, tm, to)
    unc = efficiency_uncertainty(tc, tm, to, spreads)
    out = {"t_compute": tc, "t_comm": tm, "t_overlapped": to, "spread_s": dict(spreads),
           "repeats": repeats, "efficiency_raw": raw, "efficiency": None,
           "efficiency_uncertainty": unc, "note": None}
    if raw is None:
        out["note"] = "no exchange"
    elif unc is None:
        out["note"] = f"not measurable here ({repeats} repeat: no spread to judge it by)"
    elif unc >= MEASURABLE:
        out["note"] = (f"not measurable here (±{unc:.2f} from the spread over {repeats} repeats, "
                       f"a measurement needs < {MEASURABLE}; exchange {tm * 1e3:.2f} ms)")
    else:
        out["efficiency"] = raw
        if raw < 0:
            out["note"] = "negative: together slower than one after the other, cores contended"
    return out


def efficiency_from_repeats(compute_s: list, comm_s: list, overlapped_s: list) -> dict:
    """`pass_figures` of the medians of the repeat times of t_compute, t_comm and t_overlapped,
    judged by their spreads: the efficiency when the repeats pin it to within MEASURABLE, else
    None with "not measurable here (...)" as the note."""
    times = dict(zip(TIMES, (compute_s, comm_s, overlapped_s)))
    medians = [C.median(times[k]) for k in TIMES]
    return pass_figures(*medians, {k: spread(xs) for k, xs in times.items()}, len(overlapped_s))


def run_config(group, args, seqlen: int, strategy: str, index: str) -> dict:
    """Measure one (seqlen, strategy): returns this rank's record."""
    inputs = C.make_local_inputs(group.rank, group.size, batch=args.batch, seqlen=seqlen,
                                 heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                 headdim=args.headdim, dtype=args.dtype, layout=args.layout)
    runs = {m: [] for m in MODES}
    for r in range(args.warmup + args.repeats):
        for mode in MODES:
            C.progress(f"{index} seqlen={seqlen} {strategy}: {'warmup' if r < args.warmup else 'repeat'} "
                       f"{r + 1}/{args.warmup + args.repeats} {mode}", group.rank)
            group.stats.reset()
            result = _run_mode(group, mode, strategy, inputs, args.causal, args.layout)
            result["bytes_sent"] = group.stats.bytes_sent
            if r >= args.warmup:
                runs[mode].append(result)
    ovl = runs["overlapped"]
    record = {"rank": group.rank, **_step_metrics(runs, group.link, strategy in BLOCKING),
              "e2e": {m: {"forward_s": C.median([x["forward_s"] for x in runs[m]]),
                          "fwd_bwd_s": C.median([x["fwd_bwd_s"] for x in runs[m]])} for m in MODES},
              "e2e_repeats": {"forward_s": [x["forward_s"] for x in ovl],
                              "fwd_bwd_s": [x["fwd_bwd_s"] for x in ovl]},
              "bytes_sent_fwd_bwd": ovl[-1]["bytes_sent"],
              "timeline": ovl[-1]["timeline"], "forward_end_s": ovl[-1]["forward_s"]}
    return record


def summarize(ranks: list, link: Link | None = None, blocking: bool = False) -> dict:
    """Across ranks: pass times and their spreads averaged, efficiency of the averages with the
    uncertainty of the averages (`pass_figures`); e2e: slowest rank."""
    out = {}
    for pass_ in PASSES:
        tc, tm, to = (sum(r[pass_][k] for r in ranks) / len(ranks) for k in TIMES)
        per_rank = [r[pass_]["spread_s"] for r in ranks]
        spreads = {k: None if any(s[k] is None for s in per_rank) else sum(s[k] for s in per_rank) / len(ranks)
                   for k in TIMES}
        out[pass_] = {**pass_figures(tc, tm, to, spreads, ranks[0][pass_]["repeats"]),
                      "efficiency_per_rank": [r[pass_]["efficiency"] for r in ranks],
                      "efficiency_uncertainty_per_rank": [r[pass_]["efficiency_uncertainty"] for r in ranks]}
        if link is not None:
            pred = [r[pass_] for r in ranks]
            ptm, pto, phid = (sum(p[k] for p in pred) / len(pred) for k in
                              ("t_comm_predicted", "t_overlapped_predicted", "t_hidden_predicted"))
            out[pass_].update({"efficiency_predicted": phid / ptm if ptm > 0 else None,
                               "t_comm_predicted": ptm, "t_overlapped_predicted": pto,
                               "comm_hidden_predicted": all(p["comm_hidden_predicted"] for p in pred),
                               "efficiency_predicted_per_rank": [p["efficiency_predicted"] for p in pred],
                               **link.as_dict()})
    reps = len(ranks[0]["e2e_repeats"]["forward_s"])
    for key in ("forward_s", "fwd_bwd_s"):
        out[f"e2e_{key}"] = C.median([max(r["e2e_repeats"][key][i] for r in ranks) for i in range(reps)])
    return out


def efficiency_text(p: dict) -> str:
    """The efficiency of one pass as printed: a number with its ± and the prediction, or why
    there is none; a negative one always says what it means."""
    if p["efficiency"] is None:
        text = p["note"]
    else:
        text = f"{p['efficiency']:+.2f}"
        if p["efficiency_uncertainty"] is not None:
            text += f"±{p['efficiency_uncertainty']:.2f}"
        if p["note"]:
            text += f" ({p['note']})"
    if p.get("efficiency_predicted") is not None:
        text += f" [predicted {p['efficiency_predicted']:+.2f}]"
    return text


def line(cfg: dict) -> str:
    """The one line rank 0 prints per configuration."""
    s = cfg["summary"]
    parts = [f"{cfg['strategy']:9s} N={cfg['seqlen']:<7d} B={cfg['batch']} H={cfg['heads']}/{cfg['kv_heads']} "
             f"D={cfg['headdim']} {'causal' if cfg['causal'] else 'full  '} {cfg['dtype']}"]
    for pass_ in PASSES:
        p = s[pass_]
        parts.append(f"{pass_[:3]}: comp {C.fmt_s(p['t_compute'])} comm {C.fmt_s(p['t_comm'])} "
                     f"ovl {C.fmt_s(p['t_overlapped'])} eff {efficiency_text(p)}")
    parts.append(f"e2e fwd {C.fmt_s(s['e2e_forward_s'])} fwd+bwd {C.fmt_s(s['e2e_fwd_bwd_s'])}")
    if cfg.get("link"):
        parts.append(cfg["link"])
    return " | ".join(parts)


def table_rows(configs: list) -> list:
    """One row per configuration and pass: the figures of the summary."""
    rows = []
    for cfg in configs:
        for pass_ in PASSES:
            p = cfg["summary"][pass_]
            rows.append({"strategy": cfg["strategy"], "seqlen": cfg["seqlen"], "pass": pass_,
                         "t_compute": C.fmt_s(p["t_compute"]), "t_comm": C.fmt_s(p["t_comm"]),
                         "t_overlapped": C.fmt_s(p["t_overlapped"]),
                         "efficiency": "-" if p["efficiency"] is None else f"{p['efficiency']:+.2f}",
                         "±": "-" if p["efficiency_uncertainty"] is None else f"{p['efficiency_uncertainty']:.2f}",
                         "efficiency_predicted": "-" if p.get("efficiency_predicted") is None
                         else f"{p['efficiency_predicted']:+.2f}",
                         "t_comm_predicted": C.fmt_s(p.get("t_comm_predicted")),
                         "comm_hidden_predicted": p.get("comm_hidden_predicted", "-"),
                         "link_gbps": p.get("link_gbps", "-"), "link_latency_us": p.get("link_latency_us", "-"),
                         "note": p["note"] or ""})
    return rows


TABLE_COLUMNS = ["strategy", "seqlen", "pass", "t_compute", "t_comm", "t_overlapped", "efficiency", "±",
                 "efficiency_predicted", "t_comm_predicted", "comm_hidden_predicted", "link_gbps",
                 "link_latency_us", "note"]


# ----------------------------------------------------------------------------------------------
# plot


def plot(result: dict, path: str) -> None:
    """Top: per-rank timeline (compute and comm lanes) of one configuration's overlapped run,
    forward and backward marked; then pass efficiency against seqlen per strategy, with the
    uncertainty as error bars (and, over an emulated link, the prediction dashed); with a link,
    measured against predicted with the +-0.15 band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    link = result.get("link")
    panels = 3 if link else 2
    fig, axes = plt.subplots(panels, 1, figsize=(13, 4 + 3.5 * (panels - 1)),
                             gridspec_kw={"height_ratios": [3, 2.5, 2.5][:panels]})
    _plot_timeline(axes[0], result)
    _plot_efficiency(axes[1], configs, link)
    if link:
        _plot_measured_vs_predicted(axes[2], configs, link)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_timeline(ax, result: dict) -> None:
    configs = result["configs"]
    first = configs[0]["strategy"]
    chosen = max((c for c in configs if c["strategy"] == first), key=lambda c: c["seqlen"])
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for r in chosen["ranks"]:
        for kind, a, b in r["timeline"]:
            y = 2 * r["rank"] + (0 if kind == "compute" else 1)
            ax.broken_barh([(a * 1e3, max(b - a, 1e-7) * 1e3)], (y + 0.1, 0.8), color=colors[kind],
                           edgecolor="black", linewidth=0.3)
    size = len(chosen["ranks"])
    # forward | backward: the slowest rank's forward end (every rank's backward starts after it)
    split = max(r["forward_end_s"] for r in chosen["ranks"]) * 1e3
    end = max(b for r in chosen["ranks"] for _, _, b in r["timeline"]) * 1e3
    ax.axvspan(split, max(end, split), color="grey", alpha=0.12, lw=0)
    ax.axvline(split, color="black", lw=1, ls="--")
    for x, text in ((split / 2, "forward"), ((split + max(end, split)) / 2, "backward")):
        ax.text(x, 2 * size + 0.1, text, ha="center", va="bottom", fontsize=9, weight="bold")
    ax.set_ylim(0, 2 * size + 0.8)
    ax.set_yticks([2 * r + o + 0.5 for r in range(size) for o in (0, 1)])
    ax.set_yticklabels([f"rank {r} {k}" for r in range(size) for k in ("compute", "comm")])
    ax.set_xlabel("ms since the forward pass started (dashed: forward ends on the slowest rank)")
    label = f", {result['link']}" if result.get("link") else ""
    ax.set_title(f"{chosen['strategy']} N={chosen['seqlen']}: overlapped run, "
                 f"{result['environment']['device']}{label} (comm = post to completion)")


def _plot_efficiency(ax, configs: list, link) -> None:
    cycle = iter(f"C{i}" for i in range(10))
    skipped = 0
    for strategy in dict.fromkeys(c["strategy"] for c in configs):
        color = next(cycle)
        rows = sorted((c for c in configs if c["strategy"] == strategy), key=lambda c: c["seqlen"])
        for pass_, marker, ls in (("forward", "o", "-"), ("backward", "s", ":")):
            got = [(c["seqlen"], c["summary"][pass_]) for c in rows]
            shown = [(n, p) for n, p in got if p["efficiency"] is not None]
            skipped += len(got) - len(shown)
            if shown:
                ax.errorbar([n for n, _ in shown], [p["efficiency"] for _, p in shown],
                            yerr=[p["efficiency_uncertainty"] or 0 for _, p in shown], color=color,
                            marker=marker, ls=ls, capsize=3, label=f"{strategy} {pass_}")
            pred = [(n, p["efficiency_predicted"]) for n, p in got if p.get("efficiency_predicted") is not None]
            if pred:
                ax.plot([n for n, _ in pred], [e for _, e in pred], color=color, ls="--", marker=marker,
                        mfc="none", alpha=0.6, label=f"{strategy} {pass_} predicted")
    ax.axhline(1, color="grey", lw=0.5)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global seqlen")
    ax.set_ylabel("overlap efficiency")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    title = ("(t_compute + t_comm - t_overlapped) / t_comm, mean over ranks; bars: uncertainty from "
             "the spread over repeats")
    if link:
        title += f"; {link}"
    if skipped:
        title += (f"\n{skipped} pass(es) not shown: uncertainty >= {MEASURABLE} (not measurable) "
                  f"or no exchange")
    ax.set_title(title, fontsize=9)


def _plot_measured_vs_predicted(ax, configs: list, link) -> None:
    cycle = iter(f"C{i}" for i in range(10))
    for strategy in dict.fromkeys(c["strategy"] for c in configs):
        color = next(cycle)
        for pass_, marker in (("forward", "o"), ("backward", "s")):
            pts = [(c["summary"][pass_]["efficiency_predicted"], c["summary"][pass_]["efficiency"],
                    c["summary"][pass_]["efficiency_uncertainty"] or 0) for c in configs
                   if c["strategy"] == strategy and c["summary"][pass_]["efficiency"] is not None
                   and c["summary"][pass_].get("efficiency_predicted") is not None]
            if pts:
                ax.errorbar([p for p, _, _ in pts], [m for _, m, _ in pts], yerr=[u for _, _, u in pts],
                            color=color, marker=marker, ls="none", capsize=3, label=f"{strategy} {pass_}")
    ax.plot([-0.2, 1.2], [-0.2, 1.2], color="black", lw=0.8)
    ax.fill_between([-0.2, 1.2], [-0.35, 1.05], [-0.05, 1.35], color="grey", alpha=0.15, lw=0,
                    label="predicted ± 0.15")
    ax.set_xlim(-0.2, 1.2)
    ax.set_ylim(-0.2, 1.2)
    ax.set_xlabel("predicted efficiency (bench/model/predict.py, measured compute, the link's comm)")
    ax.set_ylabel("measured efficiency")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(f"measured against predicted, every configuration and pass; {link}", fontsize=9)


# ----------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096], help="global sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default=None, choices=["contiguous", "zigzag"],
                   help="default: zigzag with --causal (balanced ranks), contiguous without")
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("--backend", default="numpy", choices=["numpy", "emulated", "cupy", "auto"])
    p.add_argument("--progress", default="thread", choices=["thread", "inline"],
                   help="MPI transfers on a progress thread (overlap) or on the caller's thread")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring", "allgather"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulate a link of this many Gb/s (burstcu.Link; MPI transport only)")
    p.add_argument("--link-latency-us", type=float, default=0.0,
                   help="with --link-gbps: microseconds per message")
    p.add_argument("--allow-unbound", action="store_true",
                   help="time even where the ranks cannot each be bound to a core of their own")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.layout is None:  # causal + contiguous leaves rank 0 idle: the imbalance would read as comm
        args.layout = "zigzag" if args.causal else "contiguous"
    return args


def main(argv=None) -> dict | None:
    args = parse(argv)
    link = None if args.link_gbps is None else Link(gbps=args.link_gbps, latency_us=args.link_latency_us)
    binding = bind_ranks(C.world()[0], args.allow_unbound)   # before init starts the progress thread
    group = burstcu.init(backend=args.backend, progress=args.progress, link=link)
    env = C.environment(group, link=None if link is None else {"describe": str(link), **link.as_dict()},
                        binding=binding)
    if group.rank == 0:
        print(C.measured_on(env))
        print(binding_line(binding))
        if link is not None:
            print(f"# {link}: every message paced to it (burstcu.Link); t_comm, efficiency and "
                  f"efficiency_predicted depend on it")
        if env["device"] != "CPU":
            print("# WARNING: step timings are host-side (enqueue) times on a GPU; use nsys for kernels")
        sys.stdout.flush()
    configs = []
    total = len(args.seqlen) * len(args.strategies)
    for i, seqlen in enumerate(args.seqlen):
        for j, strategy in enumerate(args.strategies):
            index = f"[{i * len(args.strategies) + j + 1}/{total}]"
            record = run_config(group, args, seqlen, strategy, index)
            ranks = group.comm.gather(record, root=0) if group.comm is not None and group.size > 1 else [record]
            if group.rank == 0:
                cfg = {"strategy": strategy, "seqlen": seqlen, "seqlen_local": seqlen // group.size,
                       "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
                       "headdim": args.headdim, "causal": args.causal, "layout": args.layout,
                       "dtype": args.dtype, "repeats": args.repeats,
                       "link": None if link is None else str(link),
                       "summary": summarize(ranks, link, strategy in BLOCKING), "ranks": ranks}
                configs.append(cfg)
                print(line(cfg))
                sys.stdout.flush()
    group.close()
    if group.rank != 0:
        return None
    print(C.table(table_rows(configs), TABLE_COLUMNS))
    result = {"benchmark": "overlap", "environment": env, "definitions": _definitions(),
              "link": None if link is None else str(link), "configs": configs}
    if args.json:
        C.write_json(args.json, result)
    if args.plot:
        plot(C.clean(result), args.plot)
    return result


def _definitions() -> dict:
    return {
        "t_compute": "compute_s of the step with a transport that moves nothing",
        "t_comm": "post to completion of the step's exchanges with ops that compute nothing (0: no exchange)",
        "t_overlapped": "post + compute + wait of the step with both real",
        "efficiency": "(t_compute + t_comm - t_overlapped) / t_comm: the fraction of the exchange hidden; "
                      f"null without an exchange or when efficiency_uncertainty is not below {MEASURABLE} "
                      "(not measurable: see note)",
        "efficiency_raw": "the same formula whatever the uncertainty",
        "efficiency_uncertainty": "(s_compute + s_overlapped + |t_compute - t_overlapped| / t_comm * s_comm) "
                                  "/ t_comm: spread_s carried through the formula to first order (the ± printed)",
        "spread_s": "per t_compute, t_comm, t_overlapped: the interquartile range over repeats (half the "
                    "range with 2 or 3) of the step's times, or of the pass sums (repeats_s); summary: "
                    "mean over ranks",
        "pass": "sums over the pass's steps; summary: mean over ranks, efficiency of the means",
        "repeats_s": "per rank and pass: the pass sums of t_compute, t_comm, t_overlapped of every repeat",
        "binding": "environment.binding: whether each rank was bound to a core of its own, and by whom",
        "efficiency_predicted": "with a link: bench/model/predict.py overlap_prediction from the measured "
                                "per-step t_compute and the step's messages and bytes on the link",
        "link_gbps, link_latency_us": "the emulated link (burstcu.Link), Gb/s and us per message",
        "e2e": "wall seconds of attention() and attention()+attention_backward(); summary: max over ranks",
        "timeline": "[kind, start_s, end_s] relative to the start of the overlapped forward (last repeat); "
                    "forward_end_s: where its forward ended",
    }


if __name__ == "__main__":
    main()
