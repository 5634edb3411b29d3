"""Tiny runs of every benchmark in bench/ (cpu/, gpu/ without a GPU, model/), so they never rot:
each writes its JSON and the test checks the fields, their internal consistency and the byte
formulas. The whole file runs in well under a minute on 2 cores (sizes are tiny: the numbers are
noise, only their shape is checked)."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from burstcu.selftest import MEASURABLE, NEGATIVE, judge_overlap
from tests.mpi_run import mpiexec

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))     # bench/ is imported as the package `bench`


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


def run_bench(script: str, args: list, nprocs: int | None = 2, timeout: float = 60,
              python_options: tuple = ()) -> str:
    """Run bench/<script> ("cpu/overlap.py": under mpiexec -n nprocs, or plainly when None);
    return its stdout."""
    cmd = [sys.executable, *python_options, str(BENCH / script), *map(str, args)]
    if nprocs is not None:
        cmd = [mpiexec(), "-n", str(nprocs), *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} hung for {timeout}s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _eff(tc, tm, to):
    """The fraction of the exchange hidden behind compute, as bench/cpu/overlap.py defines it."""
    return None if not tm > 0 else (tc + tm - to) / tm


def _bindable() -> bool:
    """Whether this machine lets bench/cpu/overlap.py give 2 ranks a core each."""
    from bench.cpu import overlap
    return hasattr(os, "sched_setaffinity") and len(overlap.physical_cores(os.sched_getaffinity(0))) >= 2


@pytest.mark.mpi
def test_overlap_smoke(tmp_path):
    js, png = tmp_path / "overlap.json", tmp_path / "overlap.png"
    out = run_bench("cpu/overlap.py", ["--seqlen", 64, 128, "--heads", 2, "--headdim", 16, "--repeats", 2,
                                   "--warmup", 0, "--causal", "--allow-unbound", "--json", js, "--plot", png])
    lines = [ln for ln in out.splitlines() if " | " in ln]
    assert len(lines) == 2 * 3, out                       # one line per configuration
    assert "NOT GPU figures" in out and "progress=thread" in out
    assert png.stat().st_size > 10_000
    result = json.loads(js.read_text())
    assert result["environment"]["device"] == "CPU"
    _check_binding(result["environment"]["binding"], out)
    assert {c["strategy"] for c in result["configs"]} == {"burst", "ring", "allgather"}
    from burstcu import engine
    for cfg in result["configs"]:
        assert len(cfg["ranks"]) == 2 and cfg["summary"]["e2e_fwd_bwd_s"] > cfg["summary"]["e2e_forward_s"] > 0
        for rank in cfg["ranks"]:
            fwd, bwd = rank["forward"], rank["backward"]
            assert len(fwd["steps"]) == 2 and len(bwd["steps"]) >= 2   # G steps (+ return/reduce hops)
            for p in (fwd, bwd):
                for s in p["steps"]:
                    assert all(s[k] >= 0 for k in ("t_compute", "t_comm", "t_overlapped"))
                    _check_figure(s)
                _check_figure(p)
            assert rank["timeline"] and all(b >= a for _, a, b in rank["timeline"])
            assert 0 < rank["forward_end_s"] < max(b for _, _, b in rank["timeline"])
            # bytes moved in the overlapped run == the strategy's formulas
            s_loc, h, d = cfg["seqlen"] // 2, cfg["heads"], cfg["headdim"]
            q = np.zeros((1, s_loc, h, d), np.float32)
            impl = engine.get(cfg["strategy"])
            assert rank["bytes_sent_fwd_bwd"] == impl.forward_bytes(2, q, q, q) + impl.backward_bytes(2, q, q, q)
        for pass_ in ("forward", "backward"):
            _check_figure(cfg["summary"][pass_])
        # burst's forward exchanges on step 0 only (G=2): its t_comm is positive there, 0 after
        burst_like = cfg["strategy"] != "allgather"
        steps = cfg["ranks"][0]["forward"]["steps"]
        assert (steps[0]["t_comm"] > 0) and (steps[1]["t_comm"] == 0 or not burst_like)
    _no_bare_negative(lines)


def _check_binding(binding: dict, out: str) -> None:
    """Where the machine has a core per rank, every rank ran on a core of its own (bound by the
    launcher or by the script), and the header says so."""
    if not _bindable():
        assert not binding["bound"] and "# WARNING: ranks NOT bound" in out
        return
    assert binding["bound"] and "# ranks bound to a core each " in out, out
    cpus = [set(r["cpus"]) for r in binding["per_rank"]]
    assert len(cpus) == 2 and not cpus[0] & cpus[1]
    assert [r["local_rank"] for r in binding["per_rank"]] == [0, 1]


def _check_figure(p: dict) -> None:
    """An efficiency (a step's or a pass's) is the formula's when its uncertainty, the spreads
    over repeats carried through the formula, is below 0.15; else absent with the reason; a
    negative one carries its meaning."""
    want = _eff(p["t_compute"], p["t_comm"], p["t_overlapped"])
    assert (p["efficiency_raw"] is None) == (want is None)
    spreads = p["spread_s"]
    assert all(spreads[k] >= 0 for k in ("t_compute", "t_comm", "t_overlapped"))
    if "repeats_s" in p:   # a rank's pass: 2 repeats, whose interquartile range is half the range
        for k, xs in p["repeats_s"].items():
            assert math.isclose(spreads[k], (max(xs) - min(xs)) / 2, rel_tol=1e-9, abs_tol=1e-12)
    if want is None:
        assert p["efficiency"] is None and p["efficiency_uncertainty"] is None
        return
    assert math.isclose(p["efficiency_raw"], want, rel_tol=1e-9, abs_tol=1e-12)
    # d eff / d t_compute = 1/tm, d eff / d t_overlapped = -1/tm, d eff / d t_comm = (to - tc)/tm^2
    tc, tm, to = p["t_compute"], p["t_comm"], p["t_overlapped"]
    unc = (spreads["t_compute"] + spreads["t_overlapped"] + abs(to - tc) / tm * spreads["t_comm"]) / tm
    assert math.isclose(p["efficiency_uncertainty"], unc, rel_tol=1e-9, abs_tol=1e-12)
    if unc >= 0.15:
        assert p["efficiency"] is None and p["note"].startswith("not measurable here (±")
    else:
        assert p["efficiency"] == p["efficiency_raw"]
        beyond = p["efficiency"] + unc < 0     # negative by more than its uncertainty
        assert beyond == (p["note"] is not None and p["note"].startswith("negative beyond"))


def _no_bare_negative(lines: list) -> None:
    """Every efficiency printed negative beyond its ± is followed by what it means; one within
    its ± of zero by no such note (judged from the printed, rounded, figures: where rounding
    could decide, `_check_figure` judges the JSON's exact ones)."""
    for ln in lines:
        for m in re.finditer(r"eff (-\d\.\d\d)±(\d+\.\d\d)( \(negative[^)]*\))?", ln):
            margin = float(m.group(1)) + float(m.group(2))
            if abs(margin) > 0.01:
                assert bool(m.group(3)) == (margin < 0), ln


@pytest.mark.mpi
def test_overlap_computes_on_finite_values_when_it_sends_nothing():
    """The compute-only mode sends nothing: each receive buffer gets a local copy of a send
    buffer like it (they are posted apart), so no step computes on uninitialised memory (which
    overflowed in the backward: a RuntimeWarning, here an error)."""
    run_bench("cpu/overlap.py", ["--seqlen", 128, "--heads", 2, "--headdim", 16, "--repeats", 2,
                                 "--warmup", 1, "--allow-unbound"], python_options=("-W", "error::RuntimeWarning"))


@pytest.mark.mpi
def test_overlap_over_an_emulated_link(tmp_path):
    """--link-gbps: every configuration and pass carries the link and a prediction; the measured
    exchange takes at least the link's time (the pacing is a lower bound); allgather is predicted
    to hide nothing, and so are ulysses and usp at G = 2 (usp is ulysses there: its all-to-all in
    was counted as its ring's first step's exchange, hidden behind that step's compute); every
    figure that depends on the link says so; a pass's times are the medians of its repeats' sums."""
    js, png = tmp_path / "overlap.json", tmp_path / "overlap.png"
    gbps, lat = 0.01, 100.0
    out = run_bench("cpu/overlap.py", ["--seqlen", 128, "--heads", 2, "--headdim", 16, "--repeats", 2,
                                   "--warmup", 0, "--link-gbps", gbps, "--link-latency-us", lat,
                                   "--allow-unbound", "--json", js, "--plot", png,
                                   "--strategies", "burst", "ring", "allgather", "ulysses", "usp"])
    label = "emulated link 0.01 Gb/s, 100 us"
    lines = [ln for ln in out.splitlines() if " | " in ln]
    assert len(lines) == 5 and all(ln.endswith(label) for ln in lines), out
    assert f"# {label}" in out and png.stat().st_size > 10_000
    result = json.loads(js.read_text())
    assert result["link"] == label
    kv = 2 * 64 * 2 * 16 * 4          # K and V of one rank: 64 rows, 2 heads, d 16, float32
    for cfg in result["configs"]:
        for pass_ in ("forward", "backward"):
            p = cfg["summary"][pass_]
            assert (p["link_gbps"], p["link_latency_us"]) == (gbps, lat)
            assert p["efficiency_predicted"] is not None and p["t_comm_predicted"] > 0
            assert p["t_comm"] >= 0.99 * p["t_comm_predicted"], (cfg["strategy"], pass_, p)
            _check_figure(p)
            if cfg["strategy"] in ("allgather", "ulysses", "usp"):
                assert p["efficiency_predicted"] == 0 and not p["comm_hidden_predicted"], cfg["strategy"]
            for rank in cfg["ranks"]:
                mine = rank[pass_]
                assert all(mine[t] == statistics.median(mine["repeats_s"][t])
                           for t in ("t_compute", "t_comm", "t_overlapped")), mine
        if cfg["strategy"] == "burst":      # forward: K, V in one message, one hop (G = 2)
            want = lat * 1e-6 + kv * 8 / (gbps * 1e9)
            assert math.isclose(cfg["summary"]["forward"]["t_comm_predicted"], want, rel_tol=1e-9)
    _no_bare_negative(lines)


@pytest.mark.mpi
def test_overlap_refuses_to_time_unbound():
    """With more ranks on the node than cores it cannot bind them: it exits before timing,
    saying how to launch."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) > 4:
        pytest.skip("needs a machine of at most 4 CPUs to start more ranks than cores cheaply")
    ranks = len(os.sched_getaffinity(0)) + 1
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(BENCH / "cpu/overlap.py"), "--seqlen", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode != 0 and " | " not in proc.stdout, proc.stdout
    assert "cannot bind every rank to a core of its own" in proc.stderr
    assert "mpiexec -bind-to core" in proc.stderr and "--allow-unbound" in proc.stderr


@pytest.mark.parametrize("cores, local_rank, local_size, want", [
    ([(0,), (1,)], 0, 2, (0,)),
    ([(0,), (1,)], 1, 2, (1,)),
    ([(0, 4), (1, 5), (2, 6), (3, 7)], 2, 3, (2, 6)),     # a core with its hyperthreads
    ([(0,), (1,)], 2, 3, None),                           # more ranks than cores: no binding
    ([(7,)], 0, 1, (7,)),
])
def test_overlap_binds_one_core_per_local_rank(cores, local_rank, local_size, want):
    """Unit: the node-local rank takes the core of its index when every local rank has one."""
    from bench.cpu import overlap
    assert overlap.core_for_rank(cores, local_rank, local_size) == want


def test_overlap_recognises_a_launcher_binding():
    """Unit: ranks on disjoint CPU sets were bound already; one set shared, or one rank, not."""
    from bench.cpu import overlap
    assert overlap.bound_by_launcher([[0], [1]]) and overlap.bound_by_launcher([[0, 2], [1, 3]])
    assert not overlap.bound_by_launcher([[0, 1], [0, 1]])
    assert not overlap.bound_by_launcher([[0, 1], [1, 2]])
    assert not overlap.bound_by_launcher([[0, 1]])
    with pytest.raises(ValueError, match="local rank 2 is not one of 2"):
        overlap.core_for_rank([(0,), (1,)], 2, 2)


def test_overlap_physical_cores_cover_the_cpus():
    """physical_cores partitions the CPUs this process may run on."""
    from bench.cpu import overlap
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    cpus = os.sched_getaffinity(0)
    cores = overlap.physical_cores(cpus)
    assert sorted(c for core in cores for c in core) == sorted(cpus) and cores == sorted(cores)


@pytest.mark.parametrize("compute_s, comm_s, overlapped_s, want, uncertainty", [
    # tight repeats: 10 ms compute, 4 ms exchange, 11 ms together: 0.75 hidden, ±(0.1 + 0.1 + 0) / 4
    ([0.0100, 0.0101, 0.0099], [0.0040] * 3, [0.0110, 0.0111, 0.0109], 0.75, 0.05),
    # the same medians, compute spread over ±1 ms: ±(1 + 0.1 + 0) / 4 ms
    ([0.009, 0.010, 0.011], [0.0040] * 3, [0.0110, 0.0111, 0.0109], None, 0.275),
    # an exchange that hides nothing is as uncertain as t_comm's spread too: ±(0 + 0 + 0.2) / 4
    ([0.010] * 3, [0.0038, 0.0040, 0.0042], [0.014] * 3, 0.0, 0.05),
    # one repeat: no spread, no figure
    ([0.010], [0.004], [0.011], None, None),
])
def test_overlap_prints_an_efficiency_only_when_the_repeats_pin_it(compute_s, comm_s, overlapped_s, want,
                                                                     uncertainty):
    """Unit: the gate from repeat times to a figure or "not measurable here"."""
    from bench.cpu import overlap
    fig = overlap.efficiency_from_repeats(compute_s, comm_s, overlapped_s)
    assert fig["efficiency_uncertainty"] == pytest.approx(uncertainty)
    if want is None:
        assert fig["efficiency"] is None and fig["note"].startswith("not measurable here (")
        assert overlap.efficiency_text(fig) == fig["note"]
    else:
        assert fig["efficiency"] == pytest.approx(want, abs=1e-9)
        assert overlap.efficiency_text(fig) == f"{want:+.2f}±{uncertainty:.2f}"


def test_overlap_never_prints_a_bare_figure():
    """Unit: what the line says for a measurement, a negative one, noise and no exchange."""
    from bench.cpu import overlap
    quiet = {"t_compute": 0.0001, "t_comm": 0.0001, "t_overlapped": 0.0001}
    ok = overlap.pass_figures(0.010, 0.004, 0.011, quiet, 3)
    assert ok["efficiency"] == pytest.approx(0.75) and overlap.efficiency_text(ok) == "+0.75±0.06"
    neg = overlap.pass_figures(0.010, 0.004, 0.015, quiet, 3)
    assert neg["efficiency"] == pytest.approx(-0.25)
    assert overlap.efficiency_text(neg) == f"-0.25±0.08 ({NEGATIVE})"
    # within its uncertainty of zero: a figure, no claim that together was slower
    near = overlap.pass_figures(0.010, 0.004, 0.0142, quiet, 3)
    assert near["efficiency"] == pytest.approx(-0.05) and near["note"] is None
    assert overlap.efficiency_text(near) == "-0.05±0.08"
    noisy = {"t_compute": 0.020, "t_comm": 0.0, "t_overlapped": 0.0}
    noise = overlap.pass_figures(0.010, 0.001, 0.0095, noisy, 3)
    assert noise["efficiency"] is None and noise["efficiency_raw"] == pytest.approx(1.5)
    assert overlap.efficiency_text(noise) == ("not measurable here (±20.00 from the spread over 3 repeats, "
                                              "a measurement needs < 0.15; exchange 1.00 ms)")
    none = overlap.pass_figures(0.01, 0.0, 0.01, quiet, 3)
    assert none["efficiency"] is None and none["note"] == "no exchange"


@pytest.mark.parametrize("to, spreads", [
    (0.0137, 0.00021),   # raw 0.075, uncertainty 0.154: refused
    (0.0137, 0.00020),   # 0.146: a figure
    (0.0143, 0.0001),    # raw -0.075, within its uncertainty of zero
    (0.0150, 0.0001),    # -0.25, beyond it
])
def test_overlap_bench_and_selftest_share_one_rule(to, spreads):
    """bench/cpu/overlap.py judges a pass by the selftest's rule (`judge_overlap`, one
    MEASURABLE): the same figure, and the same note about a negative one."""
    from bench.cpu import overlap
    assert overlap.MEASURABLE is MEASURABLE
    quiet = dict.fromkeys(("t_compute", "t_comm", "t_overlapped"), spreads)
    fig = overlap.pass_figures(0.010, 0.004, to, quiet, 3)
    want = judge_overlap(fig["efficiency_raw"], fig["efficiency_uncertainty"], "the spread over 3 repeats",
                         0.004)
    assert (fig["efficiency"], fig["note"]) == want
    assert (fig["efficiency"] is None) == (fig["efficiency_uncertainty"] >= MEASURABLE)


def test_model_smoke(tmp_path, capsys):
    """bench/model/predict.py: every line a PREDICTION; the overlapped pass is the library's own
    prediction (`burstcu.plan.predict`), between the larger and the sum of its parts; exposed at
    a short sequence, hidden at a long one."""
    from bench.model import predict
    from burstcu.plan import predict as plan_predict
    result = predict.main(["--preset", "h100-ib", "--seqlen", "4096", "1048576",
                           "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert all(ln.startswith("PREDICTION") or ln.lstrip().startswith(("pass", "PREDICTION"))
               for ln in out.splitlines() if ln.strip()), out
    rep = result["reports"][0]
    assert rep["kind"] == "PREDICTION"
    for row in rep["rows"]:
        # the overlapped time lies between max and sum of its parts, so 0 <= eff <= 1
        assert max(row["t_compute"], row["t_comm"]) <= row["t_overlapped"] <= row["t_compute"] + row["t_comm"]
        assert -1e-9 <= row["efficiency"] <= 1 + 1e-9
        s = row["seqlen"] // 8
        library = plan_predict("burst", {}, (1, s, 32, 128), (1, s, 32, 128), 8, causal=False,
                               layout="contiguous", dtype="bfloat16", machine=predict.PRESETS["h100-ib"])
        assert row["t_overlapped"] == getattr(library, f"{row['pass']}_s")
    hidden = rep["hidden_above_seqlen"]
    assert 4096 < hidden["forward"] < 1 << 20                     # exposed at short, hidden at long
    short = [r for r in rep["rows"] if r["seqlen"] == 4096]
    long = [r for r in rep["rows"] if r["seqlen"] == 1 << 20]
    assert not any(r["hidden"] for r in short) and all(r["hidden"] for r in long)
    assert json.loads((tmp_path / "m.json").read_text())["kind"] == "PREDICTION"


def test_model_names_the_lengths_at_which_communication_is_exposed(capsys):
    """Within a node the backward is hidden at the shortest lengths (the per-call cost exceeds the
    latency), exposed in between, hidden again above: predict.py said "exposed below" the upper
    bound, which its own table contradicted at N = 8 to 1024."""
    from bench.model import predict
    seqlens = [8, 64, 256, 1024, 2048, 4096, 16384]
    rep = predict.main(["--seqlen", *map(str, seqlens)])["reports"][0]
    out = capsys.readouterr().out
    start, above = rep["exposed_from_seqlen"]["backward"], rep["hidden_above_seqlen"]["backward"]
    assert 16 < start < above
    for r in rep["rows"]:
        if r["pass"] == "backward":
            assert r["hidden"] == (not start <= r["seqlen"] < above), r
    assert f"exposed from ~{start:,} up to it; below ~{start:,} compute outlasts it again" in out
    assert rep["exposed_from_seqlen"]["forward"] is None and "at every seqlen" in out
    exposed_everywhere = predict.main(["--preset", "h100-ib", "--link-gbs", "0.01", "--seqlen", "4096"])
    assert exposed_everywhere["reports"][0]["exposed_from_seqlen"]["forward"] == 16


def test_model_refuses_bad_options_and_names_its_overrides(capsys):
    """predict.py: counts and rates that made it trace back (--ranks 0, --tflops 0, a negative
    latency, a seqlen the ranks do not divide, which it modelled shorter than labelled) are
    usage errors; one rank (no exchange) prints its efficiency as "-"; the overrides are named in
    the heading, which otherwise stated only the preset's assumptions."""
    from bench.model import predict

    for bad in (["--ranks", "0"], ["--tflops", "0"], ["--link-gbs", "nan"], ["--latency-us", "-5"],
                ["--seqlen", "4096", "--ranks", "3"], ["--causal", "--seqlen", "4101", "--ranks", "3"]):
        with pytest.raises(SystemExit) as ended:
            predict.main(bad)
        assert ended.value.code == 2, bad
    capsys.readouterr()
    predict.main(["--ranks", "1", "--seqlen", "4096"])
    assert "        -  " in capsys.readouterr().out
    rows = predict.main(["--ranks", "3"])["reports"][0]["rows"]   # its defaults, rounded to 3
    assert sorted({r["seqlen"] for r in rows}) == [4095, 16383, 65535, 262143, 1048575]
    capsys.readouterr()
    predict.main(["--tflops", "500", "--latency-us", "1", "--seqlen", "4096"])
    assert "; OVERRIDDEN here: 500 TFLOP/s, 1 us a message" in capsys.readouterr().out.splitlines()[0]


def test_model_efficiency_is_below_one_where_communication_is_exposed():
    """The efficiency is the fraction of the exchange hidden: below 1 with slow links (exposed),
    1 in a forward whose every exchange is shorter than the compute beside it; over an emulated
    link, per step the longer direction's messages * latency + bytes / rate."""
    from bench.model import predict

    import burstcu
    result = predict.main(["--preset", "h100-ib", "--link-gbs", "5", "--seqlen", "8192", "4194304"])
    rows = result["reports"][0]["rows"]
    exposed = [r for r in rows if not r["hidden"]]
    assert exposed and any(r["hidden"] for r in rows)
    for r in exposed:
        assert r["t_comm"] > r["t_compute"] and r["efficiency"] < 1 and r["t_overlapped"] >= r["t_comm"]
    longest = next(r for r in rows if r["seqlen"] == 4194304 and r["pass"] == "forward")
    assert longest["efficiency"] == pytest.approx(1) and longest["t_overlapped"] == pytest.approx(longest["t_compute"])
    steps = [{"t_compute": 0.010, "sent_messages": 1, "sent_bytes": 10**6,
              "received_messages": 1, "received_bytes": 10**6},          # 8 ms + 50 us: hidden
             {"t_compute": 0.002, "sent_messages": 2, "sent_bytes": 10**6,
              "received_messages": 0, "received_bytes": 0}]               # 8.1 ms: 2 ms of it hidden
    link = burstcu.Link(gbps=1.0, latency_us=50)
    pred = predict.overlap_prediction(steps, link)
    assert pred["t_comm"] == pytest.approx(0.00805 + 0.0081)
    assert pred["t_overlapped"] == pytest.approx(0.010 + 0.0081)
    assert pred["efficiency"] == pytest.approx((0.00805 + 0.002) / (0.00805 + 0.0081)) and not pred["hidden"]
    assert predict.overlap_prediction(steps[:1], link)["hidden"]
    assert predict.overlap_prediction(steps, link, blocking=True)["efficiency"] == 0


@pytest.mark.mpi
def test_volume_smoke(tmp_path):
    js = tmp_path / "volume.json"
    out = run_bench("cpu/volume.py", ["--seqlen", 96, "--heads", 4, "--kv-heads", 2, "--headdim", 8,
                                  "--json", js], nprocs=3)
    assert "equal the formulas: True" in out, out
    result = json.loads(js.read_text())
    assert result["all_match"] and len(result["ranks"]) == 3
    rows = result["ranks"][0]["rows"]
    # every strategy by default (ulysses is skipped: 4 heads do not split over 3 ranks)
    assert {r["strategy"] for r in rows} == {"burst", "ring", "allgather", "usp"}
    for r in rows:
        assert r["measured_bytes"] == r["formula_bytes"] == sum(r["terms"].values())
        assert r["measured_messages"] == r["formula_messages"]
        if r["strategy"] == "usp":
            assert r["paper_bytes"] is None         # no paper formula of its own
        elif r["pass"] == "forward":
            assert r["measured_bytes"] == r["paper_bytes"]          # 2BZNd (G-1)/G exactly
        else:
            assert r["measured_bytes"] > r["paper_bytes"] > 0 and r["why_different"]


@pytest.mark.mpi
def test_a_seqlen_the_ranks_do_not_divide_is_refused(tmp_path):
    """--seqlen 255 on 2 ranks ran 254 tokens (127 rows a rank) labelled N=255."""
    cmd = [mpiexec(), "-n", "2", sys.executable, str(BENCH / "cpu/volume.py"), "--seqlen", "255"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    said = "seqlen 255 over 2 ranks: pass a multiple of 2"
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr


@pytest.mark.mpi
def test_volume_names_the_accumulation_dtype(tmp_path):
    """float64 inputs: dq and lse travel in float64, and the terms say so (they said fp32)."""
    js = tmp_path / "volume.json"
    run_bench("cpu/volume.py", ["--seqlen", 32, "--heads", 2, "--headdim", 8, "--dtype", "float64",
                                "--strategies", "burst", "--json", js], nprocs=2)
    terms = [t for r in json.loads(js.read_text())["ranks"][0]["rows"] for t in r["terms"]]
    assert any("fp64" in t for t in terms) and not any("fp32" in t for t in terms), terms


@pytest.mark.mpi
def test_volume_prints_every_rank(tmp_path):
    """Causal, contiguous: the ranks send different amounts, and the text shows each rank's row
    (it used to show rank 0's alone under "per rank"); the mean over ranks, labelled so, is the
    mean of the JSON's rows."""
    from bench._common import fmt_bytes
    js = tmp_path / "volume.json"
    out = run_bench("cpu/volume.py", ["--seqlen", 96, "--heads", 2, "--headdim", 8, "--causal",
                                      "--strategies", "burst", "ring", "--json", js], nprocs=3)
    result = json.loads(js.read_text())
    burst_fwd = [next(r for r in rank["rows"] if (r["strategy"], r["pass"]) == ("burst", "forward"))
                 for rank in result["ranks"]]
    assert len({r["measured_bytes"] for r in burst_fwd}) == 3, burst_fwd   # 1, 2 and 0 hops
    printed = {tuple(ln.split()[:4]) for ln in out.splitlines()}
    for rank in result["ranks"]:
        for r in rank["rows"]:
            row = (r["strategy"], r["pass"], str(rank["rank"]), fmt_bytes(r["measured_bytes"]))
            assert row in printed, (row, out)
    assert "this rank/paper" in out and "# over ranks: the mean of every rank's bytes" in out
    for summary in result["over_ranks"]:
        sent = [next(r["measured_bytes"] for r in rank["rows"]
                     if (r["strategy"], r["pass"]) == (summary["strategy"], summary["pass"]))
                for rank in result["ranks"]]
        assert summary["measured_bytes_per_rank"] == sent
        assert summary["mean_over_paper"] == pytest.approx(sum(sent) / 3 / summary["paper_bytes"])


@pytest.mark.mpi
def test_memory_smoke(tmp_path):
    js = tmp_path / "memory.json"
    run_bench("cpu/memory.py", ["--seqlen", 256, "--heads", 2, "--headdim", 16, "--json", js], nprocs=2)
    result = json.loads(js.read_text())
    for rank in result["ranks"]:
        for r in rank["rows"]:
            f = r["formula"]
            # the strategy's own buffers are a floor under what the call allocates
            assert r["forward_peak"] >= f["buffers"] > 0
            assert r["backward_peak"] >= r["forward_peak"] * 0.5
            assert r["forward_total"] > r["forward_peak"]


def test_local_op_smoke(tmp_path):
    """bench/cpu/local_op.py: burstcu vs naive NumPy (and torch when installed), forward and
    backward, every (threads, seqlen, mask) measured, the ratios to torch consistent."""
    js, png = tmp_path / "local.json", tmp_path / "local.png"
    out = run_bench("cpu/local_op.py", ["--seqlen", 64, 96, "--heads", 2, "--headdim", 16, "--repeats", 1,
                                        "--threads", 1, 2, "--naive-max", 64, "--score-std", 3,
                                        "--json", js, "--plot", png], nprocs=None)
    assert "measured on the CPU" in out and "score std 3," in out
    result = json.loads(js.read_text())
    rows = {(r["threads"], r["seqlen"], r["mask"], r["pass"], r["impl"]): r for r in result["results"]}
    for threads in (1, 2):
        for seqlen in (64, 96):
            for mask in ("full", "causal"):
                for pass_ in ("forward", "backward"):
                    row = rows[(threads, seqlen, mask, pass_, "burstcu")]
                    assert row["seconds"] > 0 and row["gflops"] > 0 and len(row["all_seconds"]) == 1
                    assert row["score_std"] == 3
                    flops = 4 * 2 * seqlen ** 2 * 16 * (0.5 if mask == "causal" else 1) * (2.5 if pass_ == "backward" else 1)
                    assert row["gflops"] == pytest.approx(flops / row["seconds"] / 1e9)
                    torch_row = rows.get((threads, seqlen, mask, pass_, "torch sdpa"))
                    if torch_row is None:
                        assert row["time_vs_torch"] is None
                    else:
                        assert row["time_vs_torch"] == pytest.approx(row["seconds"] / torch_row["seconds"])
    assert (1, 64, "full", "forward", "naive numpy") in rows
    assert (1, 96, "full", "forward", "naive numpy") not in rows     # above --naive-max
    assert result["environment"]["threads"] == [1, 2]
    if _installed("torch"):
        assert png.stat().st_size > 10_000


def test_gpu_run_dry_run_lists_every_step():
    """bench/gpu/run.sh --dry-run on a CPU: each step's command, none run, in the order asked;
    hopper-session expands to its steps; no step is unknown."""
    def dry(*steps):
        proc = subprocess.run(["bash", str(BENCH / "gpu" / "run.sh"), "--dry-run", *steps], capture_output=True,
                              text=True, timeout=30, cwd=ROOT, env=dict(os.environ, OUT=str(ROOT / "bench" / "out" / "dry")))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("=== ")], proc.stdout

    steps, out = dry()
    assert steps == ["env", "isa", "gate", "full", "tests", "gputests", "kbench", "overlap", "overlap_causal",
                     "tiles", "memcheck", "racecheck", "demo", "mpi", "linear", "linearbench", "varlen",
                     "steplists", "uneven", "decode"]
    assert "bench/gpu/kernel_speed.py" in out and "bench/gpu/tiles.py" in out and "unknown" not in out
    steps, out = dry("hopper-session")
    assert steps == ["env", "warm", "isa", "hopper", "hopper_bench", "tiles_sm90", "hopper_profile"]
    assert "-m burstcu.build warm --device" in out
    steps, out = dry("hopper_memcheck", "hopper_racecheck", "basic")
    assert steps == ["hopper_memcheck", "hopper_racecheck", "basic"] and "compute-sanitizer" in out
    assert "--tool memcheck --report-api-errors no" in out   # cuda-bindings' probes are no memory errors
    steps, out = dry("lists", "bwd", "steplists_mma", "hopper_profile")
    assert steps == ["lists", "bwd", "steplists_mma", "hopper_profile"] and "unknown" not in out
    assert "BURSTCU_KERNEL_TEST_ARCH=sm_90 " in out and "step_lists.py --arch sm_90 " in out and "ncu " in out
    steps, out = dry("dq_adds")
    assert steps == ["dq_adds"] and "--dq-adds pairs singles bulk" in out
    for path in {w for ln in out.splitlines() for w in ln.split() if w.startswith("bench/") and w.endswith((".py", ".sh", ".json"))}:
        assert (ROOT / path).exists(), path


def test_gpu_run_keeps_to_its_deadline_and_runs_every_decode(tmp_path):
    """bench/gpu/run.sh with a stand-in python: DEADLINE cuts each step's limit to the time left
    (less 25 s: timeout's kill grace and packing its log) and skips a step with under 45 s left,
    saying so, with every log packed and exit 1; the decode step runs each of its benchmarks
    though an earlier one fails; a second call starts from empty logs, and logs that would be
    $OUT are refused; the masked-inert tests run in the first of hopper_bwd and hopper and in
    every sanitizer step."""
    calls = tmp_path / "calls"
    fake = tmp_path / "py"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\nexit ${{FAKE_RC:-0}}\n")
    fake.chmod(0o755)
    out, logs = tmp_path / "out", tmp_path / "logs"

    def run(*steps, **env):
        proc = subprocess.run(["bash", str(BENCH / "gpu" / "run.sh"), *steps], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=dict(os.environ, OUT=str(out), LOGS=str(logs),
                                                             PY=str(fake), **env))
        with tarfile.open(out / "logs.tgz") as tar:
            names = {Path(n).name for n in tar.getnames()} - {""}     # "." names the folder
        return proc.returncode, (logs / "summary.txt").read_text(), names

    rc, summary, names = run("dq_adds", "whole_pass", DEADLINE="100")
    assert rc == 0 and "every step passed" in summary, summary
    limits = [int(x) for x in re.findall(r"limit (\d+)s", summary)]
    assert len(limits) == 2 and all(70 <= x <= 75 for x in limits), summary   # not 150
    assert {"summary.txt", "dq_adds.log", "whole_pass.log"} <= names
    rc, summary, names = run("dq_adds", "decode", DEADLINE="30")
    assert rc == 1 and "dq_adds: skipped" in summary and "decode: skipped" in summary, summary
    assert "SKIPPED steps (DEADLINE): dq_adds decode" in summary and "whole_pass" not in summary
    assert names == {"summary.txt"} and not (out / "logs.tgz.part").exists()
    calls.unlink()
    rc, summary, names = run("decode", FAKE_RC="1")
    assert rc == 1 and "FAILED steps: decode" in summary, summary
    assert calls.read_text().count("bench/decode.py") == 6          # each run, after the first failed
    script = str(BENCH / "gpu" / "run.sh")
    refused = subprocess.run(["bash", script, "env"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env=dict(os.environ, OUT=str(out), LOGS=str(out), PY=str(fake)))
    assert refused.returncode == 2 and "name a folder of its own" in refused.stdout, refused.stdout
    assert (out / "logs.tgz").exists()
    dry = subprocess.run(["bash", script, "--dry-run", "hopper_bwd", "hopper", "hopper_memcheck", "memcheck"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    inert = {line.split()[1]: "test_masked_inert_kernels.py" in line for line in dry.stdout.splitlines()
             if line.startswith("=== ")}
    assert inert == {"hopper_bwd": True, "hopper": False, "hopper_memcheck": True, "memcheck": True}, \
        dry.stdout


def test_gpu_report_merges_a_committed_run(tmp_path):
    """bench/gpu/report.py over the H200 run in bench/results/h200: a row per kernel family, each
    cell the TFLOP/s and its ratios to torch's flash and cuDNN backends, copied from the run."""
    runs = ROOT / "bench" / "results" / "h200"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu" / "report.py"), "--selftest",
                           str(runs / "run2" / "selftest_full.json"), "--kernels",
                           str(runs / "run3" / "kernels_sm90.json"), "--out", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "r.md").read_text()
    rows = json.loads((runs / "run3" / "kernels_sm90.json").read_text())["rows"]
    r = next(x for x in rows if x.get("family") == "sm90" and x["dtype"] == "bfloat16"
             and x["headdim"] == 128 and x["seqlen"] == 16384 and not x["causal"])
    cell = f"{r['tflops']:.0f} TF ({r['vs_torch']:.2f}x / {r['tflops'] / r['cudnn_tflops']:.2f}x)"
    line = next(ln for ln in md.splitlines() if ln.startswith("| fwd | sm90 | bfloat16 | 128 | False |"))
    assert line.endswith(cell + " |"), (line, cell)
    assert "| fwd | sm80 | bfloat16 | 128 | False |" in md and "84 passed" in md


def test_gpu_benchmarks_plan_without_a_gpu():
    """bench/gpu/kernel_speed.py and bench/gpu/overlap_gpu.py print their plan (--dry-run) on a CPU."""
    out = run_bench("gpu/kernel_speed.py", ["--dry-run", "--headdims", "64", "128", "--seqlens", "4096"],
                    nprocs=None)
    assert "16 configurations x 5 implementations" in out and "fwd+bwd" in out
    out = run_bench("gpu/overlap_gpu.py", ["--dry-run", "--ranks", "2", "3", "--seqlen", "12288"],
                    nprocs=None)
    assert out.count("on one GPU") == 4 and "3 ranks on one GPU, global seqlen 12288 (4096 a rank)" in out
    out = run_bench("gpu/overlap_gpu.py", ["--dry-run", "--ranks", "4", "--seqlen", "65537", "--causal",
                                       "--layout", "zigzag", "--docs", "0", "--strategies", "burst"],
                    nprocs=None)   # any length; documents from bench/_common.py's document_mix
    assert "global seqlen 65537" in out and " documents, " in out and "no documents" not in out
    out = run_bench("gpu/step_lists.py", ["--dry-run", "--seqlen", "65536", "--docs", "241"], nprocs=None)
    assert "plan: fwd and bwd, zigzag, 241 documents over 65536 tokens on 4 ranks" in out
    assert "plan: fwd and bwd, contiguous, 0" in out and "plan: fwd and bwd, documents, 241" in out
    # the packing model's tiles: fewer packed for the documents, the same for one sequence
    tiles = [tuple(map(int, re.findall(r"(\d+) a rectangle each, (\d+) packed", line)[0]))
             for line in out.splitlines() if line.startswith("plan:")]
    assert tiles[0][1] < tiles[0][0] and tiles[2][1] == tiles[2][0], tiles


@pytest.mark.emulated
def test_step_lists_on_the_emulator(tmp_path):
    """bench/gpu/step_lists.py through the emulator (its smoke test; GPU figures come from a
    GPU): per-document zigzag steps take fewer launches as lists (packed or a tile a rectangle)
    than one a rectangle, forward and backward, on the Hopper table's list kernels; "documents"
    keeps the same pairs in fewer rectangles; contiguous is its own reference."""
    js = tmp_path / "sl.json"
    out = run_bench("gpu/step_lists.py", ["--backend", "emulated", "--ranks", "2", "--seqlen", "256",
                                          "--docs", "5", "--heads", "2", "--headdim", "64",
                                          "--arch", "sm_90a", "--repeats", "1", "--json", js],
                    nprocs=None, timeout=300)
    assert out.count("NOT GPU figures") == 1 and out.count("measured bwd documents: ") == 1, out
    rows = json.loads(js.read_text())["rows"]
    assert [(r["pass"], r["layout"]) for r in rows] == [
        (p, layout) for p in ("fwd", "bwd") for layout in ("zigzag", "documents", "contiguous")]
    for (zigzag, documents, contiguous), kernel in zip(
            (rows[:3], rows[3:]), ("flash_fwd_steps_sm90", "flash_bwd_dkdv_steps_sm90")):
        assert zigzag["docs"] == documents["docs"] == 5 and kernel in zigzag["kernels_packed"], zigzag
        assert kernel in zigzag["kernels_list"], zigzag
        assert zigzag["launches_list"] < zigzag["launches_per_rect"] and zigzag["rectangles"] > 4
        assert zigzag["launches_packed"] < zigzag["launches_per_rect"]
        assert documents["rectangles"] <= zigzag["rectangles"]       # short documents whole
        assert contiguous["kept_pairs"] == 256 * 257 // 2            # causal over the 256 tokens
        assert 0 < zigzag["kept_pairs"] == documents["kept_pairs"] < contiguous["kept_pairs"]


def test_overlap_gpu_interval_arithmetic():
    """bench/gpu/overlap_gpu.py's per-step table and hidden fraction, from labelled event
    intervals (kind, engine annotation, start ms, stop ms) of two ranks."""
    from bench.gpu import overlap_gpu as og

    assert og._hidden([(0, 10)], [(5, 15)]) == 0.5
    assert og._hidden([(0, 2), (4, 6)], [(1, 5)]) == 0.5
    assert og._hidden([(0, 1)], []) is None
    rank0 = [("compute", "fwd 0 compute", 0, 10), ("comm", "fwd 0 send/recv kv", 2, 4),
             ("compute", "fwd 1 compute", 10, 20), ("comm", "bwd return dq", 30, 31)]
    rank1 = [("compute", "fwd 0 compute", 0, 8), ("comm", "fwd 0 send/recv kv", 9, 11),
             ("compute", "fwd 1 compute", 11, 19)]
    steps = {r["step"]: r for r in og.per_step([rank0, rank1])}
    assert list(steps) == ["fwd 0", "fwd 1", "bwd return"]
    assert steps["fwd 0"]["compute_ms"] == 9 and steps["fwd 0"]["copy_ms"] == 2
    assert steps["fwd 0"]["hidden"] == 0.5  # rank 0: inside its compute; rank 1: between kernels
    assert steps["fwd 1"]["copy_ms"] == 0 and steps["fwd 1"]["hidden"] is None
    assert steps["bwd return"]["copy_ms"] == 0.5 and steps["bwd return"]["hidden"] == 0.0
    assert og._step_key("ring bwd 3 send/recv") == "ring bwd 3"


@pytest.mark.mpi
def test_plan_check_smoke(tmp_path):
    js = tmp_path / "plan.json"
    out = run_bench("model/plan_check.py", ["--seqlen", 64, "--heads", 4, "--kv-heads", 4, 2, "--headdim", 8,
                                      "--repeats", 1, "--causal", "--json", js], nprocs=2)
    assert "CPU, not GPU figures" in out and "MEASURED here" in out
    result = json.loads(js.read_text())
    assert len(result["rows"]) == 2
    for row in result["rows"]:
        assert row["regret"] >= 1.0 and row["pick"] in row["measured_s"]
        assert set(row["predicted_s"]) == set(row["measured_s"])   # every candidate timed


def test_plan_check_times_what_attention_runs():
    """plan_check times every candidate with its own options: at 4 ranks the planner may offer
    burst both ways round, which it left untimed while attention did not take bidirectional."""
    from types import SimpleNamespace

    from bench.model.plan_check import time_candidates
    from burstcu.plan import Machine, plan

    machine = Machine("test", 5e11, 1e9, 1e9, 1e-5, 4, "a machine that offers it", 2e-4)
    chosen = plan((1, 512, 4, 8), (1, 512, 4, 8), SimpleNamespace(size=4, rank=0), causal=True,
                  layout="zigzag", dtype="float32", machine=machine)
    offered = [c.label for c in chosen.candidates]
    assert "burst bidirectional=True" in offered and "usp ulysses_degree=2" in offered
    calls = []
    measured = time_candidates(chosen.candidates,
                               lambda strategy, options: calls.append((strategy, options)) or 1.0)
    assert set(measured) == set(offered)
    assert ("usp", {"ulysses_degree": 2}) in calls and ("burst", {}) in calls
    assert ("burst", {"bidirectional": True}) in calls


def test_model_strategies_smoke(tmp_path):
    js = tmp_path / "model.json"
    out = run_bench("model/predict.py", ["--strategies", "--ranks", 4, "--heads", 8, "--kv-heads", 2,
                                 "--seqlen", 4096, "--causal", "--json", js], nprocs=None)
    assert out.startswith("PREDICTION") and "usp ulysses_degree=2" in out
    table = json.loads(js.read_text())["strategies"][0]
    assert {c["strategy"] for c in table["candidates"]} == {"burst", "ring", "allgather", "ulysses", "usp"}


@pytest.mark.mpi
def test_linear_smoke(tmp_path):
    """bench/cpu/linear.py on 2 ranks: lasp2's bytes are one state a pass whatever the seqlen, the
    burst ring's grow with it; --predict labels its figures."""
    js = tmp_path / "linear.json"
    run_bench("cpu/linear.py", ["--seqlens", 64, 256, "--heads", 2, "--headdim", 8, "--repeats", 1,
                            "--json", js])
    rows = {(r["seqlen"], r["strategy"]): r for r in json.loads(js.read_text())["rows"]}
    state = 1 * 2 * 8 * 8 * 4
    assert rows[(64, "lasp2")]["forward_bytes"] == rows[(256, "lasp2")]["forward_bytes"] == state
    assert rows[(256, "burst")]["forward_bytes"] == 4 * rows[(64, "burst")]["forward_bytes"] > 0
    assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows.values())
    out = run_bench("cpu/linear.py", ["--predict", "--ranks", 8, "--seqlens", 65536], nprocs=None)
    assert "PREDICTION" in out and "lasp2_over_ring" in out
    from bench.cpu import linear   # each dtype its own element size (float64 was priced as float32)
    ring = {}
    for d in ("float16", "float32", "float64"):
        linear.main(["--predict", "--seqlens", "65536", "--dtype", d, "--json", str(tmp_path / f"{d}.json")])
        ring[d] = json.loads((tmp_path / f"{d}.json").read_text())["rows"][0]["ring_s"]
    assert ring["float16"] < ring["float32"] < ring["float64"], ring


def test_varlen_schedule_smoke(tmp_path):
    """bench/cpu/varlen.py --schedule: the host time of the partition and the rectangle arrays."""
    sj = tmp_path / "schedule.json"
    out = run_bench("cpu/varlen.py", ["--schedule", "--ranks", 3, "--docs", 50, "--repeats", 2,
                                      "--json", sj], nprocs=None)
    sched = json.loads(sj.read_text())
    assert sched["documents"] == 50 and sched["ranks"] == 3 and "one step's rectangle array" in out
    assert 0 < sched["step_ms_median"] <= sched["step_ms_max"]   # a median and the most of one set
    assert sched["rank_steps_ms_max"] > 0 and sched["rank_steps_lists_ms_max"] > 0
    assert sched["rectangles_per_step_median"] >= 50   # a rectangle or more a document and step


@pytest.mark.mpi
def test_decode_bench_smoke(tmp_path):
    """bench/decode.py on 2 ranks at toy sizes: a row a cache length with every decode column,
    bytes per rank the same at every length (decode_bytes; the script asserts it against
    group.stats), prefill rows for burst, allgather and one rank; --paged on the emulated backend
    (no copy bandwidth, no torch on the CPU); --host-only a host_ms row; --predict labels every row
    PREDICTION."""
    out = tmp_path / "decode.json"
    run_bench("decode.py", ["--cache", "64", "512", "--prefill", "64", "--heads", "4",
                            "--kv-heads", "2", "--headdim", "16", "--repeats", "2", "--json", out])
    rows = json.loads(out.read_text())["rows"]
    tokens = [r for r in rows if r.get("ms_per_token") is not None]
    assert [r["cache_rows"] for r in tokens] == [64, 512] and all(r["ms_per_token"] > 0 for r in tokens)
    assert all(r["gb_per_s"] > 0 and r["host_ms"] > 0 and r["hbm_fraction"] is None and r["l2"] is None
               and r["host_bound"] is None for r in tokens)
    assert [r["cache_rows_per_rank"] for r in tokens] == [32, 256]
    assert len({r["bytes_per_rank"] for r in tokens}) == 1 and tokens[0]["bytes_per_rank"] > 0
    assert {r["strategy"] for r in rows if r.get("first_token_ms")} == {"burst", "allgather", "one rank"}
    paged = tmp_path / "paged.json"
    run_bench("decode.py", ["--backend", "emulated", "--cache", "64", "--paged", "16", "--heads", "4",
                            "--kv-heads", "2", "--headdim", "32", "--repeats", "2", "--json", paged],
              nprocs=None)
    (row,) = json.loads(paged.read_text())["rows"]
    assert row["cache_rows"] == 64 and row["ms_per_token"] > 0 and row["torch_ms"] is None
    host = tmp_path / "host.json"
    run_bench("decode.py", ["--backend", "emulated", "--host-only", "--cache", "64", "--paged", "16",
                            "--heads", "4", "--kv-heads", "2", "--headdim", "32", "--host-calls", "5",
                            "--json", host], nprocs=None)
    (row,) = json.loads(host.read_text())["rows"]
    assert row["cache_rows"] == 64 and row["host_ms"] > 0 and "ms_per_token" not in row
    pred = tmp_path / "pred.json"
    run_bench("decode.py", ["--predict", "--ranks", "1", "4", "--cache", "1024", "--json", pred],
              nprocs=None)
    predicted = json.loads(pred.read_text())
    assert all(r["kind"] == "PREDICTION" for r in predicted["rows"])
    # the GPU presets' own dtype (it modelled a float32 cache, the CPU's default, unnamed)
    assert predicted["args"]["dtype"] == "float16"
    for ignored in (["--tokens", "8"], ["--paged", "16"], ["--repeats", "3"], ["--warm-l2"],
                    ["--backend", "emulated"], ["--prefill"], ["--host-calls", "5"],
                    ["--mma-min-rows", "16"]):   # options it dropped without a word
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--predict", *ignored],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and f"leave out {ignored[0]}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("given, said", [(["--repeats", "0"], "--repeats: must be at least 1"),
                                         (["--warmup", "-1"], "--warmup -1: at least 0"),
                                         (["--strategies", "bogus"], "invalid choice: 'bogus'"),
                                         (["--link-latency-us", "5"], "give both")])
def test_overlap_refuses_bad_options_before_measuring(given, said):
    """cpu/overlap.py measured, then traced back (--repeats 0, --warmup -1: IndexError), or ran the
    whole default benchmark without the link a lone --link-latency-us asked for."""
    proc = subprocess.run([sys.executable, str(BENCH / "cpu" / "overlap.py"), *given], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", ["cpu/memory.py", "cpu/linear.py", "decode.py"])
def test_a_gpu_backend_without_a_gpu_says_so(script):
    """--backend cupy on a machine without a usable GPU: one line and status 2, as the gpu/
    scripts say it (it was burstcu.init's traceback)."""
    from burstcu.transport.bootstrap import device_count

    if device_count()[0]:
        pytest.skip("a GPU is usable here")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--backend", "cupy"], capture_output=True,
                          text=True, timeout=120, env=_env(), cwd=ROOT)
    name = script.rsplit("/", 1)[-1]
    assert proc.returncode == 2 and proc.stderr.startswith(f"# {name}: no GPU here ("), proc.stderr
    assert "Traceback" not in proc.stderr and "--dry-run" not in proc.stderr


def test_l2_flush_reads_twice_the_l2_then_waits():
    """decode.py's timed calls follow `l2_flush`: off CuPy there is none; on CuPy (here a stand-in
    over NumPy) each call reads all of one buffer of twice L2's bytes (reads only: written lines
    would be written back during the timed call), then synchronizes the device."""
    import types

    from bench import _common as C

    assert C.l2_flush(np) is None
    made, events = [], []

    class Device:
        attributes = {"L2CacheSize": 50 << 20}

        def synchronize(self):
            events.append("sync")

    def ones(n, dtype):
        made.append(np.ones(n, dtype))
        return made[-1]

    def total(x):
        events.append(("read", x is made[0], x.nbytes))
        return x.sum()

    xp = types.SimpleNamespace(__name__="cupy", cuda=types.SimpleNamespace(Device=Device), sum=total,
                               int32=np.int32, ones=ones)
    flush = C.l2_flush(xp)
    flush()
    flush()
    assert len(made) == 1 and events == [("read", True, 100 << 20), "sync"] * 2


def test_the_timers_leave_what_runs_before_a_call_untimed(monkeypatch):
    """before() (decode.py's L2 flush) runs once ahead of each timed call and outside its time: in
    call_seconds, in slowest_rank_seconds (before the barrier), and in decode.py's rows on a
    world of one, where a flush that sleeps 0.2 s leaves a token under 0.2 s."""
    import time
    import types

    from bench import _common as C
    from bench import decode

    calls = []

    def before():
        calls.append(time.perf_counter())
        time.sleep(0.2)

    times = C.call_seconds(lambda: None, 3, 0, before=before)
    assert len(calls) == 3 and max(times) < 0.2
    group = types.SimpleNamespace(barrier=lambda: calls.append("barrier"),
                                  transport=types.SimpleNamespace(allgather_object=lambda mine, what: [mine]))
    calls.clear()
    assert C.slowest_rank_seconds(group, lambda: None, 2, before=before) < 0.2
    assert [c == "barrier" for c in calls] == [False, True, False, True]
    calls.clear()
    monkeypatch.setattr(C, "l2_flush", lambda xp: before)
    rows = []
    monkeypatch.setattr(C, "print_and_write", lambda env, got, columns, args: rows.extend(got))
    assert decode.main(["--cache", "64", "--prefill", "--heads", "4", "--kv-heads", "2", "--headdim", "16",
                        "--repeats", "3", "--host-calls", "8"]) == 0
    (row,) = rows
    assert len(calls) == 3 and row["ms_per_token"] < 200 and row["l2"] is None


def _fake_cupy(log: list):
    """Just enough of CuPy for call_seconds' CUDA timing, logging each step: events (a record
    logs its event, and elapsed times follow the log), device syncs, event waits."""
    import types

    class Event:
        def record(self):
            log.append(("record", self))

        def synchronize(self):
            log.append(("wait", self))

    class Device:
        def synchronize(self):
            log.append("sync")

    def elapsed(start, stop):   # milliseconds: the calls between two records
        marks = [i for i, e in enumerate(log) if e in (("record", start), ("record", stop))]
        return float(sum(e == "call" for e in log[marks[0]:marks[1]]))
    cuda = types.SimpleNamespace(Device=Device, Event=Event, get_elapsed_time=elapsed)
    return types.SimpleNamespace(cuda=cuda)


def test_cuda_timings_wait_once_back_to_back_or_after_each_call(monkeypatch):
    """call_seconds(cuda=True): pipelined, every call between its own two events, issued back to
    back, one device sync at the end (the host's issue time hidden behind the device's); by
    default a wait after each call; sync_inside a device sync on both sides of each call. The
    warm-up runs before the first event, a sync after each of its calls."""
    from bench import _common as C

    log = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log))
    fn = lambda: log.append("call")   # noqa: E731

    def steps():
        done = [e if isinstance(e, str) else e[0] for e in log]
        log.clear()
        return done
    assert C.call_seconds(fn, 3, 2, cuda=True, pipelined=True) == [1e-3] * 3
    assert len({id(e[1]) for e in log if isinstance(e, tuple)}) == 6          # an event pair a call
    # each warm-up call waited for: a host faster than the device would queue seconds of them
    assert steps() == ["call", "sync", "call", "sync", "sync"] + ["record", "call", "record"] * 3 + ["sync"]
    assert C.call_seconds(fn, 2, 0, cuda=True) == [1e-3] * 2
    assert steps() == ["sync"] + ["record", "call", "record", "wait"] * 2
    C.call_seconds(fn, 1, 0, cuda=True, sync_inside=True)
    assert steps() == ["sync", "sync", "record", "call", "sync", "record", "wait"]
    with pytest.raises(AssertionError, match="waits only at its end"):
        C.call_seconds(fn, 1, 0, cuda=True, pipelined=True, before=lambda: None)


def test_rounds_take_the_implementations_in_turn():
    """rounds_of_calls: each round warms each implementation up, then times it inside around(),
    in turn (a, b, a, b: not a's rounds then b's); a None is skipped; per implementation every
    call's seconds and each round's median."""
    import contextlib

    from bench import _common as C

    log = []

    @contextlib.contextmanager
    def around():
        log.append("(")
        yield
        log.append(")")
    fns = [lambda: log.append("a"), None, lambda: log.append("b")]
    out = C.rounds_of_calls(fns, 2, 3, 1, around=around)
    assert "".join(log) == ("a(aaa)" "b(bbb)") * 2
    assert [len(every) for every, _ in out] == [6, 0, 6] and [len(m) for _, m in out] == [2, 0, 2]
    assert all(t >= 0 for every, _ in out for t in every)


def test_kernel_speed_times_every_implementation_alike_and_profiles_only_timed_calls(monkeypatch):
    """kernel_speed's timing_of: calls back to back ("pipelined") where torch launches on CuPy's
    stream or no torch row is asked for; the device synced around each call where torch does not,
    where it cannot say (a torch without CUDA), or with --sync-inside; decided once for the run.
    profiled(True): a device sync, the profiler started, the timed calls, a sync, the profiler
    stopped; profiled(False) touches nothing."""
    import types

    from bench.gpu import kernel_speed as K

    def decide(shares, impls=("kernels", "torch-flash"), sync_inside=False):
        monkeypatch.setattr(K, "torch_shares_cupy_stream", shares)
        args = types.SimpleNamespace(timing=None, sync_inside=sync_inside, impls=list(impls))
        got = K.timing_of(args)
        monkeypatch.setattr(K, "torch_shares_cupy_stream", lambda: not shares())   # decided once
        assert K.timing_of(args) == got
        return args.timing, got

    def unknown():
        raise RuntimeError("no CUDA GPUs are available")

    def unasked():
        raise AssertionError("asked torch")
    assert decide(lambda: True) == ("pipelined", {"pipelined": True})
    assert decide(lambda: False) == ("synced", {"sync_inside": True})
    assert decide(unknown) == ("synced", {"sync_inside": True})
    assert decide(unasked, impls=("kernels", "api")) == ("pipelined", {"pipelined": True})
    assert decide(unasked, sync_inside=True) == ("synced", {"sync_inside": True})

    log = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(deviceSynchronize=lambda: log.append("sync")),
        profiler=types.SimpleNamespace(start=lambda: log.append("start"), stop=lambda: log.append("stop"))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with K.profiled(True):
        log.append("timed")
    assert log == ["sync", "start", "timed", "sync", "stop"]
    log.clear()
    with K.profiled(False):
        log.append("timed")
    assert log == ["timed"]


def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def test_numerics_smoke(tmp_path):
    """bench/cpu/numerics.py at S = 512, G in {1, 2, 4}, bfloat16: a row for every (mask, G), every
    method's error finite, positive and at least the floor's (the correctly rounded result is
    the nearest one, element by element); one row's burstcu error recomputed here from the
    project's float64 reference and a loopback ring of this test's own."""
    from bench.cpu import numerics

    import burstcu
    from burstcu.testing.world import run_ranks
    from burstcu.testing.reference import attention_ref
    js, png = tmp_path / "numerics.json", tmp_path / "numerics.png"
    numerics.main([str(a) for a in ["--seqlen", 512, "--ranks", 1, 2, 4, "--dtypes", "bfloat16",
                                    "--json", js, "--plot", png]])
    assert png.stat().st_size > 10_000
    result = json.loads(js.read_text())
    assert result["environment"]["device"] == "CPU"
    rows = {(r["mask"], r["ranks"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 6
    assert set(rows) == {(mask, g) for mask in ("full", "causal") for g in (1, 2, 4)}
    for (mask, g), r in rows.items():
        assert r["dtype"] == "bfloat16"
        for name in ["burstcu", "rfa", "dtype-merge", "floor"] + ["burstcu-zz"] * (mask == "causal"):
            for stat in ("max", "mean"):
                err = r[f"{name}_{stat}"]
                assert math.isfinite(err) and err > 0, (mask, g, name, stat, err)
                assert err >= r[f"floor_{stat}"] * (1 - 1e-12), (mask, g, name, stat)
        for name in ("rfa", "dtype-merge"):   # at G = 1 one block, rounded once: the floor
            assert rows[(mask, 1)][f"{name}_mean"] == rows[(mask, 1)]["floor_mean"]
    q, k, v = numerics.problem(512, 1, 2, 64, "bfloat16")   # the bench's defaults: seed 0, std 1
    ref, _ = attention_ref(q, k, v, causal=True)

    def body(group):
        return burstcu.attention(*(burstcu.shard(x, group) for x in (q, k, v)), group, causal=True)

    out = np.concatenate(run_ranks(2, body, threads=1), axis=1)
    diff = np.abs(out.astype(np.float64) - ref)
    assert diff.max() == pytest.approx(rows[("causal", 2)]["burstcu_max"], rel=1e-9)
    assert diff.mean() == pytest.approx(rows[("causal", 2)]["burstcu_mean"], rel=1e-9)

@pytest.mark.parametrize("mask", ["full", "causal"])
def test_numerics_input_dtype_merges_lose_to_burstcu(mask):
    """bench/cpu/numerics.py at S = 512, bfloat16, G = 4: a ring whose running out is kept in the
    input dtype ("dtype-merge") has a larger mean error than burstcu's float32 state (1.89-1.98x
    full, 1.35-1.37x causal over seeds 0-11), and burstcu's stays within 1.2x of its G = 1 error
    (1.00x over those seeds)."""
    from bench.cpu import numerics
    result = numerics.main(["--seqlen", "512", "--ranks", "1", "4", "--dtypes", "bfloat16",
                            "--masks", mask, "--no-zigzag"])
    at4 = next(r for r in result["rows"] if r["ranks"] == 4)
    assert at4["dtype-merge_mean"] > 1.2 * at4["burstcu_mean"], at4
    assert at4["burstcu_mean_x1"] <= 1.2 and at4["burstcu_max_x1"] <= 1.2, at4

def test_numerics_floor_is_the_nearest_value():
    """bench/cpu/numerics.py's `rounded` (its floor): float64 to bfloat16 to nearest, ties to even,
    also just off a midpoint, where a cast through float32 rounds twice and misses."""
    import ml_dtypes
    from bench.cpu import numerics
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    base = rng.standard_normal(4096).astype(bf16).astype(np.float64)
    half = np.sign(base) * 2.0 ** (np.floor(np.log2(np.abs(base))) - 8)   # half a bfloat16 ulp
    up = base + 2 * half                                                     # the next one out
    for x, want in ((base + half * (1 + 2.0**-30), up), (base + half * (1 - 2.0**-30), base),
                    (base + 0.25 * half, base), (base + 1.75 * half, up)):
        assert np.array_equal(numerics.rounded(x, bf16).astype(np.float64), want)
    tie = numerics.rounded(base + half, bf16).astype(np.float64)
    assert np.all((tie == base) | (tie == up))
    assert not np.any(tie.astype(np.float32).view(np.uint32) & (1 << 16))   # even: last bit 0
    assert not np.array_equal(numerics.rounded(base + half * (1 + 2.0**-30), bf16),
                              (base + half * (1 + 2.0**-30)).astype(np.float32).astype(bf16))


@pytest.mark.parametrize("script", ["gpu/kernel_speed.py", "gpu/overlap_gpu.py", "gpu/step_lists.py"])
def test_a_gpu_script_without_a_gpu_says_so_in_one_line(script):
    """Run where no CUDA GPU is usable, a GPU script ends with status 2 and one line pointing to
    --dry-run (it ended in a raw CUDARuntimeError traceback)."""
    from burstcu.transport.bootstrap import device_count

    if device_count()[0] >= 1:
        pytest.skip("a GPU is usable here: the script would run")
    proc = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True,
                          timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2 and "no GPU here" in proc.stderr and "--dry-run" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", ["cpu/volume.py", "cpu/memory.py"])
def test_an_unknown_strategy_is_a_usage_error(script):
    """`--strategies bogus` was a ValueError traceback from the engine after the setup."""
    proc = subprocess.run([sys.executable, str(BENCH / script), "--strategies", "bogus"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2 and "invalid choice: 'bogus'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("where", ["under_a_file", "a_folder", "read_only_folder", "name_too_long"])
@pytest.mark.mpi
def test_an_unwritable_output_path_stops_before_measuring(tmp_path, where):
    """An output path the script cannot write ended the run after its work (a traceback from
    write_json once every figure was measured); now it ends at once, status 2, saying which
    option and why, on every rank (a name too long for the file system was an OSError
    traceback from the check itself)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = {"under_a_file": blocker / "sub" / "d.json", "a_folder": tmp_path,
            "name_too_long": tmp_path / ("x" * 300 + ".json")}.get(where)
    if where == "read_only_folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only folders")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        path = locked / "d.json"
    cmd = [mpiexec(), "-n", "2", sys.executable, str(BENCH / "decode.py"), "--cache", "64",
           "--prefill", "64", "--heads", "2", "--kv-heads", "1", "--headdim", "16",
           "--repeats", "1", f"--json={path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot write --json {path}" in proc.stderr, proc.stderr
    assert proc.stderr.count("cannot write") == 1, proc.stderr    # said once, by the first rank
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.mpi
def test_an_output_path_one_rank_cannot_write_ends_every_rank_at_once(tmp_path):
    """Rank 1 alone given a folder as --json (one rank's view of the paths, as on another node)
    ended alone before MPI's start, saying nothing (only the first rank spoke): under MPICH's
    mpiexec rank 0 waited in MPI's start for burstcu's timeout (600 s; measured: still there after
    250 s), and under Open MPI's the job could end before the first rank had said why. Now every
    rank ends at once, status 2, and the first rank names the rank."""
    decode = [sys.executable, str(BENCH / "decode.py"), "--cache", "64", "--prefill", "64",
              "--heads", "2", "--kv-heads", "1", "--headdim", "16", "--repeats", "1"]
    cmd = [mpiexec(), "-n", "1", *decode, f"--json={tmp_path / 'd.json'}", ":",
           "-n", "1", *decode, f"--json={tmp_path}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2 and time.monotonic() - t0 < 30, proc.stdout + proc.stderr
    assert f"cannot write --json {tmp_path}: is a folder (rank(s) [1])" in proc.stderr, proc.stderr
    assert proc.stderr.count("cannot write") == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert not (tmp_path / "d.json").exists()


def test_the_output_check_reads_both_option_spellings():
    from bench import _common as C

    argv = ["--json", "a.json", "--plot=b.png", "--table", "--cache", "--out", "o"]
    assert C._output_paths(argv) == [("--json", "a.json"), ("--plot", "b.png"), ("--out", "o")]
    assert C.unwritable(str(ROOT / "bench" / "results" / "new" / "x.json")) is None
    assert C.unwritable(str(ROOT / "bench")) == "is a folder"
