"""Overlap efficiency of the ring schedules, with the baselines measured in the same run.

    mpiexec -n G python bench/overlap.py [--seqlen N ...] [--heads H] [--headdim D] [--causal]
        [--strategies burst ring allgather ulysses usp] [--repeats R] [--json FILE] [--plot FILE]

For every configuration (global seqlen x strategy) the real engine runs three times per repeat:

  compute-only   ops as usual, transport replaced by one that moves nothing (the receive buffer
                 gets a local copy of the send buffer at post time, so values stay finite);
  comm-only      transport as usual, ops whose steps are given no blocks (no attention math; the
                 O(S*D) layout conversions around a step remain);
  overlapped     both real: what a user runs.

Per ring step, from the `burstcu.engine.Trace` the engine records (plus the host time spent posting
the step's exchange, measured by a pass-through transport wrapper):

  t_compute    = compute_s of the step in the compute-only run
  t_comm       = post + compute + wait of the step in the comm-only run (its wall time: the
                 transfer runs from post to the end of wait); 0 for a step that exchanges nothing
  t_overlapped = post + compute + wait of the step in the overlapped run
  efficiency   = (t_compute + t_comm - t_overlapped) / min(t_compute, t_comm)
                 1: the shorter of the two is fully hidden; 0: they ran back to back;
                 < 0: running them together was slower than back to back (contention for cores
                 or memory bandwidth); undefined (null) when either is 0.

Per pass (forward, backward), the same formula over the sums of the steps. Per-step figures are
medians over repeats. Each pass efficiency comes with an uncertainty: the run-to-run range of its
three times over min(t_compute, t_comm) (printed as ±); when communication is a few percent of
compute, compute jitter alone swamps it, and the efficiency says nothing. End-to-end forward and forward+backward wall times (overlapped run) are
the max over ranks, median over repeats. For "allgather" the blocking gather is step 0's wait
and the reduce-scatter hops are steps G.. of the backward pass: its efficiency is the no-overlap
baseline.

Rank 0 prints one line per configuration; --json holds every figure of every rank (gathered to
rank 0); --plot draws a per-rank timeline of compute and communication (overlapped run, largest
seqlen, first strategy) and efficiency against seqlen. On the CPU backend these are CPU + MPI
figures (BLAS on the main thread, transfers on the transport's progress thread), never GPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402  (also puts the repo root on sys.path)

import burstcu  # noqa: E402
from burstcu.engine import Trace  # noqa: E402
from burstcu.ops.base import DelegatingOps, LocalOps  # noqa: E402
from burstcu.transport.base import Transport  # noqa: E402

MODES = ("compute", "comm", "overlapped")
PASSES = ("forward", "backward")


# ----------------------------------------------------------------------------------------------
# wrappers: the real engine runs through these in every mode


class TimedTransport(Transport):
    """Pass-through (`null=False`) or do-nothing (`null=True`) transport that timestamps posts.

    It records, per commit, [post start, completion] (completion: when the progress thread's
    Waitall returned if the wrapped MPI transport has one, else the end of `wait`), and the host
    seconds spent posting since the last step (`take_post`), and every all-gather's interval.
    """

    def __init__(self, inner: Transport, null: bool):
        super().__init__(inner.rank, inner.size)
        self.inner, self.null = inner, null
        self.name = f"{'null' if null else 'timed'}({inner.name})"
        if not null:
            self.stats = inner.stats
        self.intervals: list = []   # [kind, start, end]
        self._open: list = []       # intervals whose completion is not yet known
        self._post_s, self._posts = 0.0, 0
        self.root = self            # sub-groups (USP) keep their records in the top wrapper

    # ring pattern
    def send_recv(self, send_buf, recv_buf, dst, src):
        if self.null:
            super().send_recv(send_buf, recv_buf, dst, src)
        else:
            self.inner.send_recv(send_buf, recv_buf, dst, src)

    def commit(self):
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

    def take_post(self) -> tuple[float, int]:
        """(host seconds posting, number of posts + all-gathers) since the last call."""
        out = (self._post_s, self._posts)
        self._post_s, self._posts = 0.0, 0
        return out

    # collectives
    def allgather(self, send_buf, recv_buf):
        t0 = time.perf_counter()
        if self.null:
            for j in range(self.size):
                recv_buf[j] = send_buf
        else:
            self.inner.allgather(send_buf, recv_buf)
        self.root.intervals.append(["comm", t0, time.perf_counter()])
        self.root._posts += self.size > 1  # a group of one gathers by a local copy: not communication

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
    """A `Trace` that also notes, per step, the posting time and post count since the last step."""

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
    for st, (post_s, posts) in zip(rec.steps, rec.extra):
        steps.append({"pass": st.pass_, "step": st.step, "source": st.source_rank, "blocks": st.blocks,
                      "compute_s": st.compute_s, "wait_s": st.wait_s, "post_s": post_s,
                      "exchanged": posts > 0})
    timeline = [[kind, a - t0, (b if b is not None else t2) - t0]
                for kind, a, b in ops.intervals + transport.intervals]
    return {"steps": steps, "forward_s": t1 - t0, "fwd_bwd_s": t2 - t0, "timeline": timeline}


def _step_metrics(runs: dict) -> dict:
    """Per pass: per-step t_compute, t_comm, t_overlapped, efficiency (medians over repeats)."""
    out = {}
    for pass_ in PASSES:
        keys = [(s["step"]) for s in runs["overlapped"][0]["steps"] if s["pass"] == pass_]
        steps = []
        for i, step in enumerate(keys):
            def pick(mode, f):
                vals = []
                for run in runs[mode]:
                    row = [s for s in run["steps"] if s["pass"] == pass_][i]
                    vals.append(f(row))
                return C.median(vals)
            ovl = [s for s in runs["overlapped"][0]["steps"] if s["pass"] == pass_][i]
            tc = pick("compute", lambda s: s["compute_s"])
            tm = pick("comm", lambda s: (s["post_s"] + s["compute_s"] + s["wait_s"]) if s["exchanged"] else 0.0)
            to = pick("overlapped", lambda s: s["post_s"] + s["compute_s"] + s["wait_s"])
            steps.append({"step": step, "source": ovl["source"], "blocks": ovl["blocks"],
                          "t_compute": tc, "t_comm": tm, "t_overlapped": to,
                          "efficiency": efficiency(tc, tm, to)})
        tc, tm, to = (sum(s[k] for s in steps) for k in ("t_compute", "t_comm", "t_overlapped"))
        out[pass_] = {"steps": steps, "t_compute": tc, "t_comm": tm, "t_overlapped": to,
                      "efficiency": efficiency(tc, tm, to),
                      "efficiency_uncertainty": _uncertainty(runs, pass_, min(tc, tm))}
    return out


def _pass_sums(runs: dict, mode: str, pass_: str, f) -> list:
    return [sum(f(s) for s in run["steps"] if s["pass"] == pass_) for run in runs[mode]]


def _uncertainty(runs: dict, pass_: str, shorter: float):
    """How far the pass efficiency could move with the run-to-run spread of its three times:
    (range of t_compute + range of t_comm + range of t_overlapped over repeats) / min(t_c, t_m).
    When it is >= 1 the efficiency is noise (typical on shared, oversubscribed cores)."""
    if len(runs["overlapped"]) < 2 or not shorter > 0:
        return None
    sums = [_pass_sums(runs, "compute", pass_, lambda s: s["compute_s"]),
            _pass_sums(runs, "comm", pass_, lambda s: (s["post_s"] + s["compute_s"] + s["wait_s"]) if s["exchanged"] else 0.0),
            _pass_sums(runs, "overlapped", pass_, lambda s: s["post_s"] + s["compute_s"] + s["wait_s"])]
    return sum(max(x) - min(x) for x in sums) / shorter


def efficiency(tc: float, tm: float, to: float):
    """(tc + tm - to) / min(tc, tm); None when either time is zero (nothing to overlap)."""
    shorter = min(tc, tm)
    if not shorter > 0:
        return None
    return (tc + tm - to) / shorter


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
    record = {"rank": group.rank, **_step_metrics(runs),
              "e2e": {m: {"forward_s": C.median([x["forward_s"] for x in runs[m]]),
                          "fwd_bwd_s": C.median([x["fwd_bwd_s"] for x in runs[m]])} for m in MODES},
              "e2e_repeats": {"forward_s": [x["forward_s"] for x in ovl],
                              "fwd_bwd_s": [x["fwd_bwd_s"] for x in ovl]},
              "bytes_sent_fwd_bwd": ovl[-1]["bytes_sent"],
              "timeline": ovl[-1]["timeline"]}
    return record


def summarize(ranks: list) -> dict:
    """Across ranks: pass times averaged, efficiency of the averages; e2e: slowest rank."""
    out = {}
    for pass_ in PASSES:
        tc, tm, to = (sum(r[pass_][k] for r in ranks) / len(ranks) for k in ("t_compute", "t_comm", "t_overlapped"))
        unc = [r[pass_]["efficiency_uncertainty"] for r in ranks]
        out[pass_] = {"t_compute": tc, "t_comm": tm, "t_overlapped": to, "efficiency": efficiency(tc, tm, to),
                      "efficiency_uncertainty": None if None in unc else sum(unc) / len(unc),
                      "efficiency_per_rank": [r[pass_]["efficiency"] for r in ranks]}
    reps = len(ranks[0]["e2e_repeats"]["forward_s"])
    for key in ("forward_s", "fwd_bwd_s"):
        out[f"e2e_{key}"] = C.median([max(r["e2e_repeats"][key][i] for r in ranks) for i in range(reps)])
    return out


def line(cfg: dict) -> str:
    """The one line rank 0 prints per configuration."""
    s = cfg["summary"]
    parts = [f"{cfg['strategy']:9s} N={cfg['seqlen']:<7d} B={cfg['batch']} H={cfg['heads']}/{cfg['kv_heads']} "
             f"D={cfg['headdim']} {'causal' if cfg['causal'] else 'full  '} {cfg['dtype']}"]
    for pass_ in PASSES:
        p = s[pass_]
        eff = "-" if p["efficiency"] is None else f"{p['efficiency']:+.2f}"
        if p["efficiency"] is not None and p["efficiency_uncertainty"] is not None:
            eff += f"±{p['efficiency_uncertainty']:.2f}"
        parts.append(f"{pass_[:3]}: comp {C.fmt_s(p['t_compute'])} comm {C.fmt_s(p['t_comm'])} "
                     f"ovl {C.fmt_s(p['t_overlapped'])} eff {eff}")
    parts.append(f"e2e fwd {C.fmt_s(s['e2e_forward_s'])} fwd+bwd {C.fmt_s(s['e2e_fwd_bwd_s'])}")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------
# plot


def plot(result: dict, path: str) -> None:
    """Top: per-rank timeline (compute and comm lanes) of one configuration's overlapped run;
    bottom: pass efficiency against seqlen per strategy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    first = configs[0]["strategy"]
    chosen = max((c for c in configs if c["strategy"] == first), key=lambda c: c["seqlen"])
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(11, 7.5), gridspec_kw={"height_ratios": [3, 2]})
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for r in chosen["ranks"]:
        for kind, a, b in r["timeline"]:
            y = 2 * r["rank"] + (0 if kind == "compute" else 1)
            ax0.broken_barh([(a * 1e3, max(b - a, 1e-7) * 1e3)], (y + 0.1, 0.8), color=colors[kind],
                            edgecolor="black", linewidth=0.3)
    size = len(chosen["ranks"])
    ax0.set_yticks([2 * r + o + 0.5 for r in range(size) for o in (0, 1)])
    ax0.set_yticklabels([f"rank {r} {k}" for r in range(size) for k in ("compute", "comm")])
    ax0.set_xlabel("ms since the forward pass started (forward, then backward)")
    ax0.set_title(f"{chosen['strategy']} N={chosen['seqlen']}: overlapped run, "
                  f"{result['environment']['device']} (comm = post to completion)")
    for strategy in dict.fromkeys(c["strategy"] for c in configs):
        rows = sorted((c for c in configs if c["strategy"] == strategy), key=lambda c: c["seqlen"])
        for pass_, style in (("forward", "-o"), ("backward", "--s")):
            xs = [c["seqlen"] for c in rows if c["summary"][pass_]["efficiency"] is not None]
            ys = [c["summary"][pass_]["efficiency"] for c in rows if c["summary"][pass_]["efficiency"] is not None]
            if xs:
                ax1.plot(xs, ys, style, label=f"{strategy} {pass_}")
    ax1.axhline(1, color="grey", lw=0.5)
    ax1.axhline(0, color="grey", lw=0.5)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("global seqlen")
    ax1.set_ylabel("overlap efficiency")
    ax1.legend(fontsize=8)
    ax1.set_title("(t_compute + t_comm - t_overlapped) / min(t_compute, t_comm), mean over ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.layout is None:  # causal + contiguous leaves rank 0 idle: the imbalance would read as comm
        args.layout = "zigzag" if args.causal else "contiguous"
    return args


def main(argv=None) -> dict | None:
    args = parse(argv)
    group = burstcu.init(backend=args.backend, progress=args.progress)
    env = C.environment(group)
    if group.rank == 0:
        print(C.measured_on(env))
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
                       "dtype": args.dtype, "repeats": args.repeats, "summary": summarize(ranks),
                       "ranks": ranks}
                configs.append(cfg)
                print(line(cfg))
                sys.stdout.flush()
    group.close()
    if group.rank != 0:
        return None
    result = {"benchmark": "overlap", "environment": env, "definitions": _definitions(),
              "configs": configs}
    if args.json:
        C.write_json(args.json, result)
    if args.plot:
        plot(C.clean(result), args.plot)
    return result


def _definitions() -> dict:
    return {
        "t_compute": "compute_s of the step with a transport that moves nothing",
        "t_comm": "post + compute + wait of the step with ops that compute nothing (0: no exchange)",
        "t_overlapped": "post + compute + wait of the step with both real",
        "efficiency": "(t_compute + t_comm - t_overlapped) / min(t_compute, t_comm); null if a term is 0",
        "pass": "sums over the pass's steps; summary: mean over ranks, efficiency of the means",
        "efficiency_uncertainty": "(range over repeats of the pass sums of t_compute, t_comm, t_overlapped) "
                                  "/ min(t_compute, t_comm); >= 1 means the efficiency is noise",
        "e2e": "wall seconds of attention() and attention()+attention_backward(); summary: max over ranks",
        "timeline": "[kind, start_s, end_s] relative to the start of the overlapped forward (last repeat)",
    }


if __name__ == "__main__":
    main()
