"""Overlap efficiency of the ring schedules, with the baselines measured in the same run.

    mpiexec -bind-to core -n G python bench/cpu/overlap.py [--seqlen N ...] [--heads H] [--headdim D]
        [--causal] [--strategies burst ring allgather ulysses usp] [--repeats R] [--json FILE]
        [--plot FILE] [--link-gbps X [--link-latency-us Y]]

Bind each rank to a core (MPICH: -bind-to core; Open MPI: --bind-to core): unbound, the
scheduler moves the ranks about and a step's compute varied by up to 40% between repeats here
(2 ranks on 2 cores, N = 2048: 106-167 ms unbound, 102-109 ms bound).

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
medians over repeats. A pass efficiency is reported only when it is a measurement: its jitter
(the interquartile ranges over repeats of the pass sums of t_compute, t_comm and t_overlapped,
added; compute dominates it) must be smaller than t_comm, else the line says "not measurable
here (compute jitter ±X ms > exchange Y ms)" and the JSON holds efficiency null (the raw figure
as efficiency_raw); a negative one is printed with what it means. On a CPU the exchange through
shared memory takes about a millisecond, less than compute jitter: emulate a link (below). End-to-end forward and forward+backward wall times (overlapped run) are the max over
ranks, median over repeats. For "allgather" the blocking gather is step 0's wait and the
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
against seqlen with its jitter as error bars (with a link: the prediction beside it, and measured
against predicted). On the CPU backend these are CPU + MPI figures (BLAS on the main thread,
transfers on the transport's progress thread), never GPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.model.predict import overlap_prediction  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine import Trace  # noqa: E402
from burstcu.ops.base import DelegatingOps, LocalOps  # noqa: E402
from burstcu.transport.base import Transport  # noqa: E402
from burstcu.transport.link import Link  # noqa: E402

MODES = ("compute", "comm", "overlapped")
PASSES = ("forward", "backward")
# strategies whose exchange completes before the compute that follows it (burstcu.engine.allgather:
# "No overlap: the gather is blocking, by design of the baseline"): the model hides nothing there
BLOCKING = {"allgather"}
TRAFFIC = ("sent_messages", "sent_bytes", "received_messages", "received_bytes")


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


class TimedOps(DelegatingOps):
    """Delegates to `inner`; timestamps each step; with compute=False a step gets no blocks."""

    def __init__(self, inner: LocalOps, compute: bool):
        super().__init__(inner)
        self.compute = compute
        self.intervals: list = []

    def _run(self, fn, *args):
        t0 = time.perf_counter()
        fn(*args)
        self.intervals.append(["compute", t0, time.perf_counter()])

    def forward_step(self, state, k, v, blocks):
        self._run(self.inner.forward_step, state, k, v, blocks if self.compute else [])

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None):
        self._run(self.inner.backward_step, ctx, q, dout, lse, delta, dq,
                  blocks if self.compute else [], psum)


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
    """Per pass: per-step t_compute, t_comm, t_overlapped, efficiency (medians over repeats),
    and the pass figures (`pass_figures`)."""
    out = {}
    for pass_ in PASSES:
        ovl_steps = [s for s in runs["overlapped"][0]["steps"] if s["pass"] == pass_]
        steps = []
        for i, ovl in enumerate(ovl_steps):
            def pick(mode):
                f = _step_time(mode)
                return C.median([f([s for s in run["steps"] if s["pass"] == pass_][i])
                                 for run in runs[mode]])
            tc, tm, to = pick("compute"), pick("comm"), pick("overlapped")
            steps.append({"step": ovl["step"], "source": ovl["source"], "blocks": ovl["blocks"],
                          "t_compute": tc, "t_comm": tm, "t_overlapped": to,
                          "efficiency": C.overlap_efficiency(tc, tm, to),
                          **{k: ovl[k] for k in TRAFFIC}})
        tc, tm, to = (sum(s[k] for s in steps) for k in ("t_compute", "t_comm", "t_overlapped"))
        sums = _pass_sums(runs, pass_)
        out[pass_] = {"steps": steps, **pass_figures(tc, tm, to, _jitter(sums), len(runs["overlapped"])),
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
    names = dict(zip(MODES, ("t_compute", "t_comm", "t_overlapped")))
    return {names[mode]: [sum(_step_time(mode)(s) for s in run["steps"] if s["pass"] == pass_)
                          for run in runs[mode]] for mode in MODES}


def _jitter(sums: dict) -> float | None:
    """Seconds the pass's three times spread over repeats: the interquartile ranges of the pass
    sums of t_compute, t_comm and t_overlapped, added (half the range with 2 or 3 repeats).
    Like the medians it qualifies, it ignores one repeat slowed by another process; None with
    one repeat."""
    if len(sums["t_overlapped"]) < 2:
        return None
    spread = 0.0
    for xs in sums.values():
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        spread += q3 - q1
    return spread


def pass_figures(tc: float, tm: float, to: float, jitter: float | None, repeats: int) -> dict:
    """A pass's times, its efficiency when it is a measurement, and what to say otherwise.

    efficiency_raw: (tc + tm - to) / tm, whatever the noise; efficiency: the same, or None when
    there is no exchange or the jitter is at least t_comm (the efficiency could then be anything
    between its bounds); efficiency_uncertainty: jitter / t_comm (the ± printed); note: why the
    efficiency is missing or what a negative one means."""
    raw = C.overlap_efficiency(tc, tm, to)
    out = {"t_compute": tc, "t_comm": tm, "t_overlapped": to, "jitter_s": jitter, "repeats": repeats,
           "efficiency_raw": raw, "efficiency": raw,
           "efficiency_uncertainty": None if jitter is None or raw is None else jitter / tm,
           "note": None}
    if raw is None:
        out["note"] = "no exchange in this pass"
    elif jitter is not None and jitter >= tm:
        out["efficiency"] = None
        out["note"] = (f"not measurable here (compute jitter ±{jitter * 1e3:.2f} ms > exchange "
                       f"{tm * 1e3:.2f} ms)")
    elif raw < 0:
        out["note"] = "negative: together slower than one after the other, cores contended"
    elif jitter is None:
        out["note"] = "one repeat: spread unknown"
    return out


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
    """Across ranks: pass times averaged, efficiency of the averages (measurable when the mean
    jitter is below the mean t_comm); e2e: slowest rank."""
    out = {}
    for pass_ in PASSES:
        tc, tm, to = (sum(r[pass_][k] for r in ranks) / len(ranks) for k in ("t_compute", "t_comm", "t_overlapped"))
        jit = [r[pass_]["jitter_s"] for r in ranks]
        jitter = None if None in jit else sum(jit) / len(jit)
        out[pass_] = {**pass_figures(tc, tm, to, jitter, ranks[0][pass_]["repeats"]),
                      "efficiency_per_rank": [r[pass_]["efficiency"] for r in ranks]}
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
    jitter as error bars (and, over an emulated link, the prediction dashed); with a link,
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
    title = "(t_compute + t_comm - t_overlapped) / t_comm, mean over ranks; bars: jitter over repeats"
    if link:
        title += f"; {link}"
    if skipped:
        title += f"\n{skipped} pass(es) not shown: jitter >= exchange (not measurable) or no exchange"
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
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.layout is None:  # causal + contiguous leaves rank 0 idle: the imbalance would read as comm
        args.layout = "zigzag" if args.causal else "contiguous"
    return args


def main(argv=None) -> dict | None:
    args = parse(argv)
    link = None if args.link_gbps is None else Link(gbps=args.link_gbps, latency_us=args.link_latency_us)
    group = burstcu.init(backend=args.backend, progress=args.progress, link=link)
    env = C.environment(group, link=None if link is None else {"describe": str(link), **link.as_dict()})
    if group.rank == 0:
        print(C.measured_on(env))
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
                      "null without an exchange or when jitter_s >= t_comm (not measurable: see note)",
        "efficiency_raw": "the same formula whatever the jitter",
        "pass": "sums over the pass's steps; summary: mean over ranks, efficiency of the means",
        "jitter_s": "sum over t_compute, t_comm, t_overlapped of the interquartile range over repeats "
                    "of the pass sums (repeats_s)",
        "repeats_s": "per rank and pass: the pass sums of t_compute, t_comm, t_overlapped of every repeat",
        "efficiency_uncertainty": "jitter_s / t_comm (the ± printed)",
        "efficiency_predicted": "with a link: bench/model/predict.py overlap_prediction from the measured "
                                "per-step t_compute and the step's messages and bytes on the link",
        "link_gbps, link_latency_us": "the emulated link (burstcu.Link), Gb/s and us per message",
        "e2e": "wall seconds of attention() and attention()+attention_backward(); summary: max over ranks",
        "timeline": "[kind, start_s, end_s] relative to the start of the overlapped forward (last repeat); "
                    "forward_end_s: where its forward ended",
    }


if __name__ == "__main__":
    main()
