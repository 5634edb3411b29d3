"""Overlap efficiency of the ring schedules: per ring step and pass, compute-only, comm-only and
overlapped time of the real engine, measured in the same run, and the fraction of the exchange
hidden behind compute (bench/README.md says how each time is obtained and read).

    mpiexec -bind-to core -n G python bench/cpu/overlap.py [--seqlen N ...] [--causal]
        [--strategies burst ring allgather ...] [--repeats R] [--json F] [--plot F]
        [--link-gbps X [--link-latency-us Y]] [--allow-unbound]

efficiency = (t_compute + t_comm - t_overlapped) / t_comm, printed with its uncertainty (the
spreads over repeats carried through the formula) only when that is below 0.15. Each rank runs
on a core of its own (the launcher's binding, or this script's), or nothing is timed.
--link-gbps runs over an emulated link (`burstcu.Link`) and adds bench/model/predict.py's
`overlap_prediction` to every pass. CPU + MPI figures of the schedule, never GPU ones.
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

MODES = ("compute", "comm", "overlapped")
TIMES = ("t_compute", "t_comm", "t_overlapped")   # what MODES measure, in that order
PASSES = ("forward", "backward")
BLOCKING = {"allgather"}    # its exchange completes before the compute after it: hides nothing
TRAFFIC = ("sent_messages", "sent_bytes", "received_messages", "received_bytes")
MEASURABLE = 0.15           # the largest uncertainty at which an efficiency is printed


# ----------------------------------------------------------------------------------------------
# the engine runs through these in every mode


class TimedTransport(Transport):
    """Pass-through (null=False) or do-nothing (null=True: the receive buffer gets a local copy
    of the send buffer) transport that records, per commit, [post, completion] (completion: when
    the MPI progress thread finished it, else the end of `wait`), posting time and traffic."""

    def __init__(self, inner: Transport, null: bool):
        super().__init__(inner.rank, inner.size)
        self.inner, self.null, self.root = inner, null, self   # sub-groups record in the root
        self.name = f"{'null' if null else 'timed'}({inner.name})"
        if not null:
            self.stats = inner.stats
        self.intervals, self._open, self._step = [], [], []
        self._post_s, self._posts, self._traffic = 0.0, 0, dict.fromkeys(TRAFFIC, 0)

    def send_recv(self, send_buf, recv_buf, dst, src):
        (super() if self.null else self.inner).send_recv(send_buf, recv_buf, dst, src)

    def _count(self, sent: list, received: list) -> None:
        t = self.root._traffic
        t["sent_messages"] += len(sent)
        t["sent_bytes"] += sum(sent)
        t["received_messages"] += len(received)
        t["received_bytes"] += sum(received)

    def _record(self, iv, post: bool) -> None:
        root = self.root
        root.intervals.append(iv)
        root._posts += post
        if post:
            root._step.append(iv)

    def commit(self):
        queued = self._queued if self.null else self.inner._queued
        self._count([x.nbytes for x, _, _, _ in queued if x is not None],
                    [y.nbytes for _, y, _, _ in queued if y is not None])
        t0 = time.perf_counter()
        (super() if self.null else self.inner).commit()
        self.root._post_s += time.perf_counter() - t0
        iv = ["comm", t0, None]
        self._record(iv, True)
        self.root._open.append(iv)
        pending = getattr(self.inner, "_pending", None)   # a peek at the MPI thread's futures
        if not self.null and pending:
            pending[-1].add_done_callback(lambda _f, iv=iv: iv.__setitem__(2, time.perf_counter()))

    def wait(self):
        (super() if self.null else self.inner).wait()
        now = time.perf_counter()
        for iv in self.root._open:
            iv[2] = now if iv[2] is None else iv[2]
        self.root._open = []

    def _post(self, exchanges):  # null mode only
        for send_buf, recv_buf, _, _ in exchanges:
            if send_buf is not None and recv_buf is not None and send_buf.nbytes == recv_buf.nbytes:
                recv_buf[...] = send_buf

    def _wait(self):
        pass

    def take_post(self) -> tuple[float, int, dict]:
        """(host seconds posting, posts, traffic with comm_s = the time the step's exchanges
        covered from post to completion) since the last call, made after the step's wait."""
        comm_s, reach = 0.0, float("-inf")
        for a, b in sorted((a, b) for _, a, b in self._step if b is not None):
            if b > reach:
                comm_s, reach = comm_s + b - max(a, reach), b
        out = (self._post_s, self._posts, {**self._traffic, "comm_s": comm_s})
        self._post_s, self._posts, self._traffic, self._step = 0.0, 0, dict.fromkeys(TRAFFIC, 0), []
        return out

    def allgather(self, send_buf, recv_buf):
        t0 = time.perf_counter()
        if self.null:
            for j in range(self.size):
                recv_buf[j] = send_buf
        else:
            self.inner.allgather(send_buf, recv_buf)
        self._record(["comm", t0, time.perf_counter()], self.size > 1)   # one rank: a local copy
        pieces = [send_buf.nbytes] * (self.size - 1)
        self._count(pieces, pieces)

    def allgather_object(self, obj, what="metadata"):
        self.inner.call, self.inner.where = self.call, self.where
        return self.inner.allgather_object(obj, what)

    def _abort(self, reason):
        self.inner._abort(reason)

    def barrier(self):
        self.inner.barrier()

    def _split(self, color, key, members, name):
        sub = TimedTransport(self.inner.split(color, key, name), self.null)
        sub.root = self.root
        return sub


class TimedOps(C.StepTimingOps):
    def timed(self, fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        self.intervals.append(["compute", t0, time.perf_counter()])


class StepRecorder(Trace):
    """A `Trace` that also notes, per step, the transport's `take_post`."""

    def __init__(self, transport: TimedTransport):
        super().__init__()
        self.transport, self.extra = transport, []

    def add(self, *args) -> None:
        super().add(*args)
        self.extra.append(self.transport.take_post())


# ----------------------------------------------------------------------------------------------
# binding: each rank on a core of its own, or no timings


def physical_cores(cpus) -> list[tuple[int, ...]]:
    """The logical CPUs in `cpus` grouped by physical core (hyperthreads together, from sysfs;
    each CPU alone where that is unreadable), ordered by their first CPU."""
    cpus, cores = set(cpus), set()
    for cpu in cpus:
        siblings = {cpu}
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            for part in text.strip().split(","):
                first, _, last = part.partition("-")
                siblings.update(range(int(first), int(last or first) + 1))
        except (OSError, ValueError):
            pass
        cores.add(tuple(sorted(siblings & cpus)))
    return sorted(cores)


def core_for_rank(cores: list, local_rank: int, local_size: int):
    """The core node-local rank `local_rank` of `local_size` binds to, or None when the node
    has fewer cores than ranks."""
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not one of {local_size} ranks")
    return cores[local_rank] if len(cores) >= local_size else None


def bound_by_launcher(affinities: list) -> bool:
    """Whether the node-local ranks (one CPU set each) run on CPUs of their own already."""
    sets = [set(a) for a in affinities]
    return len(sets) > 1 and sum(map(len, sets)) == len(set().union(*sets))


def bind_ranks(comm, allow_unbound: bool) -> dict:
    """Bind every thread of this rank to the core of its node-local rank (and BLAS to that core)
    unless the launcher has; collective. Where some rank stays unbound every rank exits saying
    how to launch, unless `allow_unbound`. Returns {bound, how, per_rank}."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    local_rank, affinities = 0, [mine]
    if comm is not None:
        from mpi4py import MPI   # here: importing mpi4py initialises MPI; `comm` proves it loads
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local_rank, affinities = local.Get_rank(), local.allgather(mine)
        local.Free()
    rec = {"bound": False, "how": None, "cpus": mine, "local_rank": local_rank,
           "local_size": len(affinities), "why": None}
    cores = None if mine is None else physical_cores(mine)
    core = None if cores is None else core_for_rank(cores, local_rank, len(affinities))
    if mine is None or not hasattr(os, "sched_setaffinity"):
        rec["why"] = "this platform has no os.sched_setaffinity"
    elif bound_by_launcher(affinities):
        rec.update(bound=True, how="by the launcher")
    elif any(a != mine for a in affinities):
        rec["why"] = "the ranks on this node have different, overlapping CPU sets"
    elif core is None:
        rec["why"] = f"{len(affinities)} ranks on this node share {len(cores)} core(s)"
    else:
        for tid in [int(t.name) for t in Path("/proc/self/task").iterdir()]:
            try:
                os.sched_setaffinity(tid, core)   # BLAS and MPI threads; later ones inherit
            except ProcessLookupError:
                pass
        try:
            from threadpoolctl import threadpool_limits
            threadpool_limits(limits=len(core))
            blas = f"limited to {len(core)}"
        except ImportError:
            blas = "unchanged: threadpoolctl is not installed"
        rec.update(bound=True, cpus=list(core),
                   how=f"by this script (os.sched_setaffinity, BLAS threads {blas})")
    every = [rec] if comm is None else comm.allgather(rec)
    unbound = "; ".join(f"rank {i}: {r['why']}" for i, r in enumerate(every) if not r["bound"])
    if unbound and not allow_unbound:
        if comm is not None and comm.Get_rank() != 0:
            raise SystemExit(2)
        raise SystemExit(f"overlap.py: cannot bind every rank to a core of its own ({unbound}). "
                         f"Unbound, the scheduler moves ranks between cores and the repeats "
                         f"disagree. Launch bound, e.g. mpiexec -bind-to core -n G python "
                         f"bench/cpu/overlap.py ... (Open MPI: --bind-to core), with at least as "
                         f"many cores as ranks per node; or pass --allow-unbound to time anyway.")
    return {"bound": all(r["bound"] for r in every),
            "how": "; ".join(dict.fromkeys(r["how"] or r["why"] for r in every)), "per_rank": every}


def binding_line(binding: dict) -> str:
    cpus = ", ".join(f"rank {i} -> CPU {','.join(map(str, r['cpus'] or ['?']))}"
                     for i, r in enumerate(binding["per_rank"]))
    if binding["bound"]:
        return f"# ranks bound to a core each {binding['how']}: {cpus}"
    return (f"# WARNING: ranks NOT bound ({binding['how']}): {cpus}; the scheduler moves them "
            f"and most efficiencies read 'not measurable here'")


# ----------------------------------------------------------------------------------------------
# the figures and their uncertainty


def spread(xs: list) -> float | None:
    """The interquartile range of the repeat times (half the range with 2 or 3 repeats); None
    with fewer than 2."""
    if len(xs) < 2:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def pass_figures(tc: float, tm: float, to: float, spreads: dict, repeats: int) -> dict:
    """A pass's (or step's) times and its efficiency when it is a measurement: the uncertainty
    (s_compute + s_overlapped + |tc - to| / tm * s_comm) / tm below MEASURABLE; else None and a
    note why (or what a negative one means)."""
    raw = C.overlap_efficiency(tc, tm, to)
    unc = None
    if tm > 0 and all(spreads.get(k) is not None for k in TIMES):
        unc = (spreads["t_compute"] + spreads["t_overlapped"] + abs(tc - to) / tm * spreads["t_comm"]) / tm
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
    """`pass_figures` of the medians of the repeat times, judged by their spreads."""
    times = dict(zip(TIMES, (compute_s, comm_s, overlapped_s)))
    return pass_figures(*(C.median(times[k]) for k in TIMES),
                        {k: spread(xs) for k, xs in times.items()}, len(overlapped_s))


def efficiency_text(p: dict) -> str:
    """The efficiency as printed: a number with its ± (and the prediction), or why there is none."""
    text = p["note"]
    if p["efficiency"] is not None:
        text = f"{p['efficiency']:+.2f}"
        if p["efficiency_uncertainty"] is not None:
            text += f"±{p['efficiency_uncertainty']:.2f}"
        if p["note"]:
            text += f" ({p['note']})"
    if p.get("efficiency_predicted") is not None:
        text += f" [predicted {p['efficiency_predicted']:+.2f}]"
    return text


# ----------------------------------------------------------------------------------------------
# one configuration


def step_time(mode: str, s: dict) -> float:
    """What a step's record contributes to t_compute, t_comm or t_overlapped."""
    if mode == "compute":
        return s["compute_s"]
    if mode == "comm":
        return s["comm_s"] if s["exchanged"] else 0.0
    return s["post_s"] + s["compute_s"] + s["wait_s"]


def run_mode(group, mode: str, strategy: str, inputs, causal: bool, layout: str) -> dict:
    """One forward + backward pass in `mode`: this rank's step records and pass times."""
    transport = TimedTransport(group.transport, null=(mode == "compute"))
    ops = TimedOps(group.ops, compute=(mode != "comm"))
    rec = StepRecorder(transport)
    g = dataclasses.replace(group, transport=transport, ops=ops, trace=rec)
    q, k, v, dout = inputs
    kw = dict(causal=causal, layout=layout, strategy=strategy)
    group.barrier()
    t0 = time.perf_counter()
    out, lse = burstcu.attention(q, k, v, g, return_lse=True, **kw)
    t1 = time.perf_counter()
    burstcu.attention_backward(dout, q, k, v, out, lse, g, **kw)
    t2 = time.perf_counter()
    steps = [{"pass": st.pass_, "step": st.step, "source": st.source_rank, "blocks": st.blocks,
              "compute_s": st.compute_s, "wait_s": st.wait_s, "post_s": post_s,
              "exchanged": posts > 0, **traffic}
             for st, (post_s, posts, traffic) in zip(rec.steps, rec.extra)]
    timeline = [[kind, a - t0, (b if b is not None else t2) - t0]
                for kind, a, b in ops.intervals + transport.intervals]
    return {"steps": steps, "forward_s": t1 - t0, "fwd_bwd_s": t2 - t0, "timeline": timeline}


def predicted(steps: list, link, blocking: bool) -> dict:
    if link is None:
        return {}
    pred = overlap_prediction(steps, link, blocking)
    return {"efficiency_predicted": pred["efficiency"], "t_comm_predicted": pred["t_comm"],
            "t_overlapped_predicted": pred["t_overlapped"], "t_hidden_predicted": pred["t_hidden"],
            "comm_hidden_predicted": pred["hidden"], **link.as_dict()}


def run_config(group, args, seqlen: int, strategy: str, index: str) -> dict:
    """Measure one (seqlen, strategy): this rank's record."""
    inputs = C.local_inputs(group, args, seqlen=seqlen, layout=args.layout)
    runs = {m: [] for m in MODES}
    for r in range(args.warmup + args.repeats):
        for mode in MODES:
            C.progress(f"{index} seqlen={seqlen} {strategy}: {'warmup' if r < args.warmup else 'repeat'}"
                       f" {r + 1}/{args.warmup + args.repeats} {mode}", group.rank)
            group.stats.reset()
            result = run_mode(group, mode, strategy, inputs, args.causal, args.layout)
            result["bytes_sent"] = group.stats.bytes_sent
            if r >= args.warmup:
                runs[mode].append(result)
    record = {"rank": group.rank}
    for pass_ in PASSES:
        per_mode = {m: [[s for s in run["steps"] if s["pass"] == pass_] for run in runs[m]] for m in MODES}
        steps = []
        for i, ovl in enumerate(per_mode["overlapped"][0]):
            figures = efficiency_from_repeats(*([step_time(m, run[i]) for run in per_mode[m]] for m in MODES))
            steps.append({"step": ovl["step"], "source": ovl["source"], "blocks": ovl["blocks"],
                          **figures, **{k: ovl[k] for k in TRAFFIC}})
        sums = {t: [sum(step_time(m, s) for s in run) for run in per_mode[m]] for m, t in zip(MODES, TIMES)}
        record[pass_] = {"steps": steps, "repeats_s": sums,
                         **pass_figures(*(sum(s[k] for s in steps) for k in TIMES),
                                        {k: spread(xs) for k, xs in sums.items()}, args.repeats),
                         **predicted(steps, group.link, strategy in BLOCKING)}
    ovl = runs["overlapped"]
    record.update(e2e_repeats={key: [x[key] for x in ovl] for key in ("forward_s", "fwd_bwd_s")},
                  bytes_sent_fwd_bwd=ovl[-1]["bytes_sent"], timeline=ovl[-1]["timeline"],
                  forward_end_s=ovl[-1]["forward_s"])
    return record


def summarize(ranks: list, link) -> dict:
    """Across ranks: pass times and spreads averaged, `pass_figures` of the averages; the
    predictions averaged; e2e: the slowest rank, median over repeats."""
    out, n = {}, len(ranks)
    for pass_ in PASSES:
        per = [r[pass_] for r in ranks]
        spreads = {k: None if any(p["spread_s"][k] is None for p in per)
                   else sum(p["spread_s"][k] for p in per) / n for k in TIMES}
        out[pass_] = {**pass_figures(*(sum(p[k] for p in per) / n for k in TIMES), spreads,
                                     per[0]["repeats"]),
                      "efficiency_per_rank": [p["efficiency"] for p in per],
                      "efficiency_uncertainty_per_rank": [p["efficiency_uncertainty"] for p in per]}
        if link is not None:
            ptm, pto, phid = (sum(p[k] for p in per) / n for k in
                              ("t_comm_predicted", "t_overlapped_predicted", "t_hidden_predicted"))
            out[pass_].update(efficiency_predicted=phid / ptm if ptm > 0 else None,
                              t_comm_predicted=ptm, t_overlapped_predicted=pto,
                              comm_hidden_predicted=all(p["comm_hidden_predicted"] for p in per),
                              efficiency_predicted_per_rank=[p["efficiency_predicted"] for p in per],
                              **link.as_dict())
    for key in ("forward_s", "fwd_bwd_s"):
        reps = zip(*(r["e2e_repeats"][key] for r in ranks))
        out[f"e2e_{key}"] = C.median([max(x) for x in reps])
    return out


def line(cfg: dict) -> str:
    """The one line rank 0 prints per configuration."""
    s = cfg["summary"]
    parts = [f"{cfg['strategy']:9s} N={cfg['seqlen']:<7d} B={cfg['batch']} H={cfg['heads']}/"
             f"{cfg['kv_heads']} D={cfg['headdim']} {'causal' if cfg['causal'] else 'full  '} {cfg['dtype']}"]
    parts += [f"{p[:3]}: comp {C.fmt_s(s[p]['t_compute'])} comm {C.fmt_s(s[p]['t_comm'])} "
              f"ovl {C.fmt_s(s[p]['t_overlapped'])} eff {efficiency_text(s[p])}" for p in PASSES]
    parts.append(f"e2e fwd {C.fmt_s(s['e2e_forward_s'])} fwd+bwd {C.fmt_s(s['e2e_fwd_bwd_s'])}")
    return " | ".join(parts + ([cfg["link"]] if cfg.get("link") else []))


def plot(result: dict, path: str) -> None:
    """Top: per-rank timeline of the largest seqlen of the first strategy (overlapped run,
    forward and backward split); below: pass efficiency against seqlen with its uncertainty
    (dashed: the prediction over an emulated link)."""
    plt = C.pyplot()
    configs = result["configs"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 7.5), gridspec_kw={"height_ratios": [3, 2.5]})
    chosen = max((c for c in configs if c["strategy"] == configs[0]["strategy"]), key=lambda c: c["seqlen"])
    for r in chosen["ranks"]:
        for kind, a, b in r["timeline"]:
            y = 2 * r["rank"] + (kind != "compute") + 0.1
            ax.broken_barh([(a * 1e3, max(b - a, 1e-7) * 1e3)], (y, 0.8),
                           color="tab:blue" if kind == "compute" else "tab:orange", edgecolor="black", lw=0.3)
    size = len(chosen["ranks"])
    ax.axvline(max(r["forward_end_s"] for r in chosen["ranks"]) * 1e3, color="black", lw=1, ls="--")
    ax.set_yticks([2 * r + o + 0.5 for r in range(size) for o in (0, 1)],
                  [f"rank {r} {k}" for r in range(size) for k in ("compute", "comm")])
    ax.set_xlabel("ms since the forward pass started (dashed: forward ends on the slowest rank)")
    ax.set_title(f"{chosen['strategy']} N={chosen['seqlen']}: overlapped run, "
                 f"{result['environment']['device']} {result.get('link') or ''}")
    for i, strategy in enumerate(dict.fromkeys(c["strategy"] for c in configs)):
        rows = sorted((c for c in configs if c["strategy"] == strategy), key=lambda c: c["seqlen"])
        for pass_, marker, ls in (("forward", "o", "-"), ("backward", "s", ":")):
            got = [(c["seqlen"], c["summary"][pass_]) for c in rows]
            shown = [(n, p) for n, p in got if p["efficiency"] is not None]
            if shown:
                ax2.errorbar([n for n, _ in shown], [p["efficiency"] for _, p in shown],
                             yerr=[p["efficiency_uncertainty"] or 0 for _, p in shown], color=f"C{i}",
                             marker=marker, ls=ls, capsize=3, label=f"{strategy} {pass_}")
            pred = [(n, p["efficiency_predicted"]) for n, p in got
                    if p.get("efficiency_predicted") is not None]
            if pred:
                ax2.plot(*zip(*pred), color=f"C{i}", ls="--", marker=marker, mfc="none", alpha=0.6,
                         label=f"{strategy} {pass_} predicted")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("global seqlen")
    ax2.set_ylabel("overlap efficiency")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax2.set_title(f"(t_compute + t_comm - t_overlapped) / t_comm, mean over ranks; bars: uncertainty; "
                  f"passes with uncertainty >= {MEASURABLE} not shown", fontsize=9)
    C.save(fig, path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096], help="global lengths")
    C.add_shape_args(p)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default=None, choices=["contiguous", "zigzag"],
                   help="default: zigzag with --causal (balanced ranks), contiguous without")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring", "allgather"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--link-gbps", type=float, default=None, help="emulate a link of this many Gb/s")
    p.add_argument("--link-latency-us", type=float, default=0.0, help="its microseconds a message")
    p.add_argument("--allow-unbound", action="store_true", help="time even where ranks are not bound")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.layout = args.layout or ("zigzag" if args.causal else "contiguous")
    return args


def main(argv=None) -> dict | None:
    args = parse(argv)
    link = None if args.link_gbps is None else Link(gbps=args.link_gbps, latency_us=args.link_latency_us)
    binding = bind_ranks(C.world()[0], args.allow_unbound)   # before the progress thread starts
    group = burstcu.init(backend="numpy", link=link)
    env = C.environment(group, link=None if link is None else {"describe": str(link), **link.as_dict()},
                        binding=binding)
    if group.rank == 0:
        print(C.measured_on(env) + "\n" + binding_line(binding))
        if link is not None:
            print(f"# {link}: every message paced to it (burstcu.Link); t_comm, efficiency and "
                  f"efficiency_predicted depend on it")
    configs, total = [], len(args.seqlen) * len(args.strategies)
    for i, (seqlen, strategy) in enumerate((n, s) for n in args.seqlen for s in args.strategies):
        record = run_config(group, args, seqlen, strategy, f"[{i + 1}/{total}]")
        ranks = C.gather(group, record)
        if group.rank == 0:
            configs.append({"strategy": strategy, "seqlen": seqlen, "seqlen_local": seqlen // group.size,
                            "batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads or args.heads,
                            "headdim": args.headdim, "causal": args.causal, "layout": args.layout,
                            "dtype": args.dtype, "repeats": args.repeats,
                            "link": None if link is None else str(link),
                            "summary": summarize(ranks, link), "ranks": ranks})
            print(line(configs[-1]), flush=True)
    group.close()
    if group.rank != 0:
        return None
    result = {"benchmark": "overlap", "environment": env, "link": None if link is None else str(link),
              "configs": configs}
    C.emit(None, result, args)
    if args.plot:
        plot(C.clean(result), args.plot)
    return result


if __name__ == "__main__":
    main()
