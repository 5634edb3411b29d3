"""Overlap efficiency of the ring schedules: per ring step and pass, compute-only, comm-only and
overlapped time of the real engine, measured in the same run, and the fraction of the exchange
hidden behind compute (bench/README.md says how each time is obtained and read).

    mpiexec -bind-to core -n G python bench/cpu/overlap.py [--seqlen N ...] [--causal]
        [--strategies burst ring allgather ...] [--repeats R] [--json F] [--plot F]
        [--link-gbps X [--link-latency-us Y]] [--allow-unbound]
"""

from __future__ import annotations

import argparse
import contextlib
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
from burstcu import engine  # noqa: E402
from burstcu.selftest import MEASURABLE, judge_overlap  # noqa: E402  (one rule for both)
from burstcu.transport.base import Transport  # noqa: E402
from burstcu.transport.link import Link  # noqa: E402

MODES = ("compute", "comm", "overlapped")
TIMES = ("t_compute", "t_comm", "t_overlapped")   # what MODES measure, in that order
PASSES = ("forward", "backward")
BLOCKING = {"allgather"}    # its exchange completes before the compute after it: hides nothing
TRAFFIC = ("sent_messages", "sent_bytes", "received_messages", "received_bytes")


class TimedTransport(Transport):
    """The transport of one of MODES: pass-through, or for "compute" do-nothing. It and its
    sub-groups record in `root` ["comm", post, completion] per commit (completion: the MPI progress
    thread's, else the end of `wait`), posting time and traffic; as the engine's `Trace`, `root`
    keeps `steps`: per step pass, step, source, blocks, traffic and `time` (its share of the mode's)."""

    def __init__(self, inner: Transport, mode: str, root: TimedTransport | None = None):
        super().__init__(inner.rank, inner.size)
        self.inner, self.mode, self.null = inner, mode, mode == "compute"
        self.root = self if root is None else root
        self.name = f"{'null' if self.null else 'timed'}({inner.name})"
        self.intervals, self._open, self.steps = [], [], []
        self._step, self._post_s, self._traffic = [], 0.0, dict.fromkeys(TRAFFIC, 0)

    def send_recv(self, send_buf, recv_buf, dst, src):
        (super() if self.null else self.inner).send_recv(send_buf, recv_buf, dst, src)

    def _record(self, iv: list, post: bool, sent: list, received: list) -> None:
        """Note an exchange: its interval (one of the step's posts when `post`), its messages' sizes."""
        root = self.root
        root.intervals.append(iv)
        root._step += [iv] * post
        for side, sizes in (("sent", sent), ("received", received)):
            root._traffic[f"{side}_messages"] += len(sizes)
            root._traffic[f"{side}_bytes"] += sum(sizes)

    def commit(self):
        queued = self._queued if self.null else self.inner._queued
        sizes = ([x.nbytes for x, _, _, _ in queued if x is not None],
                 [y.nbytes for _, y, _, _ in queued if y is not None])
        t0 = time.perf_counter()
        (super() if self.null else self.inner).commit()
        self.root._post_s += time.perf_counter() - t0
        iv = ["comm", t0, None]
        self._record(iv, True, *sizes)
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

    def _post(self, exchanges):  # null mode only: each receive a local copy of a send like it
        sends = [x for x, _, _, _ in exchanges if x is not None]   # (posted apart from the receives)
        for _, recv_buf, _, _ in exchanges:
            if recv_buf is not None:
                like = next((x for x in sends if x.shape == recv_buf.shape and x.dtype == recv_buf.dtype),
                            None)
                recv_buf[...] = 0 if like is None else like

    def _wait(self):
        pass

    def add(self, pass_: str, step: int, source: int, blocks: int, compute_s: float, wait_s: float):
        """`Trace.add`, after the step's wait; comm: what its exchanges covered, post to completion."""
        comm_s, reach = 0.0, float("-inf")
        for a, b in sorted((a, b) for _, a, b in self._step if b is not None):
            if b > reach:
                comm_s, reach = comm_s + b - max(a, reach), b
        times = {"compute": compute_s, "comm": comm_s, "overlapped": self._post_s + compute_s + wait_s}
        self.steps.append({"pass": pass_, "step": step, "source": source, "blocks": blocks,
                           "time": times[self.mode], **self._traffic})
        self._step, self._post_s, self._traffic = [], 0.0, dict.fromkeys(TRAFFIC, 0)

    def allgather(self, send_buf, recv_buf):
        t0 = time.perf_counter()
        if self.null:
            recv_buf[...] = send_buf   # every rank's piece: this one
        else:
            self.inner.allgather(send_buf, recv_buf)
        pieces = [send_buf.nbytes] * (self.size - 1)
        self._record(["comm", t0, time.perf_counter()], self.size > 1, pieces, pieces)   # 1 rank: no post

    def allgather_object(self, obj, what="metadata"):
        self.inner.call, self.inner.where = self.call, self.where
        return self.inner.allgather_object(obj, what)

    def _abort(self, reason):
        self.inner._abort(reason)

    def barrier(self):
        self.inner.barrier()

    def _split(self, color, key, members, name):
        return TimedTransport(self.inner.split(color, key, name), self.mode, self.root)


class TimedOps(C.StepTimingOps):
    """`StepTimingOps` noting ("compute", label, clock() before, clock() after) per step: host
    seconds, or (bench/gpu/overlap_gpu.py) recorded CUDA events. The label is `where`, the
    engine's latest annotation ("fwd 2 compute")."""

    def __init__(self, inner, compute: bool, clock=time.perf_counter):
        super().__init__(inner, compute)
        self.clock, self.where = clock, "start"

    def annotate(self, label: str):
        self.where = label
        return self.inner.annotate(label)

    def timed(self, fn, *args):
        label, start = self.where, self.clock()
        fn(*args)
        self.intervals.append(("compute", label, start, self.clock()))


def forward_backward(group, inputs: list, clock, **kw) -> tuple:
    """One forward then backward pass of `group` on this rank's q, k, v, dout (`inputs`):
    clock() before, between and after."""
    q, k, v, dout = inputs
    t0 = clock()
    out, lse = burstcu.attention(q, k, v, group, return_lse=True, **kw)
    t1 = clock()
    burstcu.attention_backward(dout, q, k, v, out, lse, group, **kw)
    return t0, t1, clock()


def physical_cores(cpus) -> list[tuple[int, ...]]:
    """The logical CPUs in `cpus` grouped by physical core (hyperthreads together, from sysfs;
    each CPU alone where that is unreadable), ordered by their first CPU."""
    cpus, cores = set(cpus), set()
    for cpu in cpus:
        siblings = {cpu}
        with contextlib.suppress(OSError, ValueError):
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
            for first, _, last in (part.partition("-") for part in text.strip().split(",")):
                siblings.update(range(int(first), int(last or first) + 1))
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
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, core)   # BLAS and MPI threads; later ones inherit
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


def spread(xs: list) -> float | None:
    """The interquartile range of the repeat times (half the range with 2 or 3 repeats); None
    with fewer than 2."""
    if len(xs) < 2:
        return None
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def pass_figures(tc: float, tm: float, to: float, spreads: dict, repeats: int) -> dict:
    """A pass's (or step's) times (seconds) and its efficiency when it is a measurement: the
    uncertainty (s_compute + s_overlapped + |tc - to| / tm * s_comm) / tm below MEASURABLE, by
    `burstcu.selftest.judge_overlap` (the selftest's rule); else None and a note why (or what
    one negative beyond its uncertainty means)."""
    raw, unc = C.overlap_efficiency(tc, tm, to), None
    if tm > 0 and all(spreads.get(k) is not None for k in TIMES):
        unc = (spreads["t_compute"] + spreads["t_overlapped"] + abs(tc - to) / tm * spreads["t_comm"]) / tm
    out = {"t_compute": tc, "t_comm": tm, "t_overlapped": to, "spread_s": dict(spreads),
           "repeats": repeats, "efficiency_raw": raw, "efficiency": None,
           "efficiency_uncertainty": unc, "note": None}
    if raw is not None and unc is None:
        out["note"] = f"not measurable here ({repeats} repeat: no spread to judge it by)"
    else:
        out["efficiency"], out["note"] = judge_overlap(raw, unc, f"the spread over {repeats} repeats", tm)
    return out


def efficiency_from_repeats(compute_s: list, comm_s: list, overlapped_s: list) -> dict:
    """`pass_figures` of the medians of the repeat times, judged by their spreads."""
    times = dict(zip(TIMES, (compute_s, comm_s, overlapped_s)))
    return pass_figures(*(C.median(xs) for xs in times.values()),
                        {k: spread(xs) for k, xs in times.items()}, len(overlapped_s))


def efficiency_text(p: dict) -> str:
    """The efficiency as printed: a number with its ± (and the prediction), or why there is none."""
    text = p["note"]
    if p["efficiency"] is not None:
        text = f"{p['efficiency']:+.2f}±{p['efficiency_uncertainty']:.2f}"   # a measurement has both
        if p["note"]:
            text += f" ({p['note']})"
    if p.get("efficiency_predicted") is not None:
        text += f" [predicted {p['efficiency_predicted']:+.2f}]"
    return text


def run_config(group, args, seqlen: int, strategy: str, index: str) -> dict:
    """Measure one (seqlen, strategy): this rank's record."""
    inputs = C.local_inputs(group, args, seqlen=seqlen, layout=args.layout)
    runs, total = {m: [] for m in MODES}, args.warmup + args.repeats
    for r in range(total):
        for mode in MODES:
            C.progress(f"{index} seqlen={seqlen} {strategy}: {'warmup' if r < args.warmup else 'repeat'}"
                       f" {r + 1}/{total} {mode}", group.rank)
            group.stats.reset()
            transport, ops = TimedTransport(group.transport, mode), TimedOps(group.ops, mode != "comm")
            g = dataclasses.replace(group, transport=transport, ops=ops, trace=transport)
            group.barrier()
            t0, t1, t2 = forward_backward(g, inputs, time.perf_counter, strategy=strategy,
                                          causal=args.causal, layout=args.layout)
            if r >= args.warmup:
                runs[mode].append({"steps": transport.steps, "forward_s": t1 - t0, "fwd_bwd_s": t2 - t0,
                                   "bytes_sent": group.stats.bytes_sent,
                                   "timeline": [[kind, a - t0, (b if b is not None else t2) - t0]
                                                for kind, *_, a, b in ops.intervals + transport.intervals]})
    record, link = {"rank": group.rank}, group.link
    for pass_ in PASSES:
        per_mode = {m: [[s for s in run["steps"] if s["pass"] == pass_] for run in runs[m]] for m in MODES}
        steps = [{"step": ovl["step"], "source": ovl["source"], "blocks": ovl["blocks"],
                  **efficiency_from_repeats(*([run[i]["time"] for run in per_mode[m]] for m in MODES)),
                  **{k: ovl[k] for k in TRAFFIC}} for i, ovl in enumerate(per_mode["overlapped"][0])]
        sums = {t: [sum(s["time"] for s in run) for run in per_mode[m]] for m, t in zip(MODES, TIMES)}
        record[pass_] = {"steps": steps, "repeats_s": sums,   # the medians of the repeats' step sums
                         **efficiency_from_repeats(*(sums[t] for t in TIMES))}
        if link is not None:
            pred = overlap_prediction(steps, link, strategy in BLOCKING)
            record[pass_].update({f"{k}_predicted": pred[k] for k in ("efficiency", "t_comm", "t_overlapped",
                                                                      "t_hidden")},
                                 comm_hidden_predicted=pred["hidden"], **link.as_dict())
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
            ptm, pto, phid = (sum(p[f"t_{k}_predicted"] for p in per) / n
                              for k in ("comm", "overlapped", "hidden"))
            out[pass_].update(efficiency_predicted=phid / ptm if ptm > 0 else None,
                              t_comm_predicted=ptm, t_overlapped_predicted=pto,
                              comm_hidden_predicted=all(p["comm_hidden_predicted"] for p in per),
                              efficiency_predicted_per_rank=[p["efficiency_predicted"] for p in per],
                              **link.as_dict())
    for key in ("forward_s", "fwd_bwd_s"):
        out[f"e2e_{key}"] = C.median([max(x) for x in zip(*(r["e2e_repeats"][key] for r in ranks))])
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


def overlap_figure(timelines: list, title: str, xlabel: str, curves: list, ylabel: str):
    """(figure, timeline axes, curve axes). Top: per rank a compute lane (blue) and a comm lane
    (orange) of `timelines` (per rank [(kind, start ms, stop ms)]); below: `curves`
    [(label, line style, [(global seqlen, y, error bar or None)])], the empty ones left out."""
    fig, (ax, ax2) = C.pyplot().subplots(2, 1, figsize=(13, 7.5), gridspec_kw={"height_ratios": [3, 2.5]})
    for rank, timeline in enumerate(timelines):
        for kind, a, b in timeline:
            ax.broken_barh([(a, max(b - a, 1e-4))], (2 * rank + (kind != "compute") + 0.1, 0.8),
                           color="tab:blue" if kind == "compute" else "tab:orange", edgecolor="black", lw=0.3)
    ax.set_yticks([2 * r + o + 0.5 for r in range(len(timelines)) for o in (0, 1)],
                  [f"rank {r} {k}" for r in range(len(timelines)) for k in ("compute", "comm")])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    for label, style, points in filter(lambda curve: curve[2], curves):
        xs, ys, errors = zip(*points)
        ax2.errorbar(xs, ys, yerr=None if None in errors else errors, capsize=3, label=label, **style)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("global seqlen")
    ax2.set_ylabel(ylabel)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig, ax, ax2


def plot(result: dict, path: str) -> None:
    """Top: per-rank timeline of the largest seqlen of the first strategy (overlapped run,
    forward and backward split); below: pass efficiency against seqlen with its uncertainty
    (dashed: the prediction over an emulated link)."""
    configs, curves = result["configs"], []
    chosen = max((c for c in configs if c["strategy"] == configs[0]["strategy"]), key=lambda c: c["seqlen"])
    for i, strategy in enumerate(dict.fromkeys(c["strategy"] for c in configs)):
        for pass_, marker, ls in (("forward", "o", "-"), ("backward", "s", ":")):
            got = sorted(((c["seqlen"], c["summary"][pass_]) for c in configs if c["strategy"] == strategy),
                         key=lambda x: x[0])
            style = dict(color=f"C{i}", marker=marker)
            curves += [(f"{strategy} {pass_}", {**style, "ls": ls},
                        [(n, p["efficiency"], p["efficiency_uncertainty"] or 0) for n, p in got
                         if p["efficiency"] is not None]),
                       (f"{strategy} {pass_} predicted", {**style, "ls": "--", "mfc": "none", "alpha": 0.6},
                        [(n, p["efficiency_predicted"], None) for n, p in got
                         if p.get("efficiency_predicted") is not None])]
    fig, ax, ax2 = overlap_figure(
        [[(kind, a * 1e3, b * 1e3) for kind, a, b in r["timeline"]] for r in chosen["ranks"]],
        f"{chosen['strategy']} N={chosen['seqlen']}: overlapped run, "
        f"{result['environment']['device']} {result.get('link') or ''}",
        "ms since the forward pass started (dashed: forward ends on the slowest rank)", curves,
        "overlap efficiency")
    ax.axvline(max(r["forward_end_s"] for r in chosen["ranks"]) * 1e3, color="black", lw=1, ls="--")
    ax2.set_title(f"(t_compute + t_comm - t_overlapped) / t_comm, mean over ranks; bars: uncertainty; "
                  f"passes with uncertainty >= {MEASURABLE} not shown", fontsize=9)
    C.save(fig, path)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=C.positive, nargs="+", default=[1024, 2048, 4096], help="global lengths")
    C.add_shape_args(p)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default=None, choices=["contiguous", "zigzag"],
                   help="default: zigzag with --causal (balanced ranks), contiguous without")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring", "allgather"],
                   choices=list(engine.NAMES))
    p.add_argument("--repeats", type=C.positive, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--link-gbps", type=C.at_least(0, strict=True), default=None,
                   help="emulate a link of this many Gb/s")
    p.add_argument("--link-latency-us", type=C.at_least(0), default=None, help="its microseconds a message")
    p.add_argument("--allow-unbound", action="store_true", help="time even where ranks are not bound")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: at least 0")
    if args.link_latency_us is not None and args.link_gbps is None:
        p.error("--link-latency-us describes the link --link-gbps emulates: give both")
    args.link_latency_us = args.link_latency_us or 0.0
    args.layout = args.layout or ("zigzag" if args.causal else "contiguous")
    args.kv_heads = args.kv_heads or args.heads
    link = None if args.link_gbps is None else Link(gbps=args.link_gbps, latency_us=args.link_latency_us)
    label = None if link is None else str(link)
    binding = bind_ranks(C.world()[0], args.allow_unbound)   # before the progress thread starts
    group = burstcu.init(backend="numpy", link=link)
    env = C.environment(group, link=None if link is None else {"describe": label, **link.as_dict()},
                        binding=binding)
    if group.rank == 0:
        cpus = ", ".join(f"rank {i} -> CPU {','.join(map(str, r['cpus'] or ['?']))}"
                         for i, r in enumerate(binding["per_rank"]))
        print(C.measured_on(env) + "\n" + (
            f"# ranks bound to a core each {binding['how']}: {cpus}" if binding["bound"] else
            f"# WARNING: ranks NOT bound ({binding['how']}): {cpus}; the scheduler moves them "
            f"and most efficiencies read 'not measurable here'"))
        if link is not None:
            print(f"# {link}: every message paced to it (burstcu.Link); t_comm, efficiency and "
                  f"efficiency_predicted depend on it")
    configs, plan = [], [(n, s) for n in args.seqlen for s in args.strategies]
    for i, (seqlen, strategy) in enumerate(plan):
        ranks = C.gather(group, run_config(group, args, seqlen, strategy, f"[{i + 1}/{len(plan)}]"))
        if group.rank == 0:
            shape = ("batch", "heads", "kv_heads", "headdim", "causal", "layout", "dtype", "repeats")
            configs.append({"strategy": strategy, "seqlen": seqlen, "seqlen_local": seqlen // group.size,
                            **{k: getattr(args, k) for k in shape}, "link": label,
                            "summary": summarize(ranks, link), "ranks": ranks})
            print(line(configs[-1]), flush=True)
    group.close()
    if group.rank != 0:
        return None
    result = {"benchmark": "overlap", "environment": env, "link": label, "configs": configs}
    C.emit(None, result, args)
    if args.plot:
        plot(C.clean(result), args.plot)
    return result


if __name__ == "__main__":
    main()
