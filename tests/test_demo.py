"""The README's main job (burstcu.demo) runs under mpiexec, reports small errors and the
formula's byte counts on every rank, and ends with one verdict line per rank that every rank
agrees on: PASSED and exit code 0, or FAILED (a wrong row planted in a result) and non-zero.
The times it reports are of a warmed-up pass."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import burstcu
from burstcu import demo
from tests.mpi_run import ROOT, mpiexec

SMALL_JOB = ["--seqlen", "384", "--heads", "4", "--kv-heads", "2", "--headdim", "32", "--causal",
             "--backend", "numpy"]

# The demo with one result corrupted on some ranks: burstcu.attention (out) or
# burstcu.attention_backward (dq, dk) wrapped to add 1 to one local row, every head and batch row.
PLANTED_WRONG_ROW = """
import json
import sys

from mpi4py import MPI

import burstcu
from burstcu import demo

plan = json.loads(sys.argv[1])
honest_forward, honest_backward = burstcu.attention, burstcu.attention_backward


def plant(x, group, quantity):
    if plan["quantity"] == quantity and group.rank in plan["ranks"]:
        x[:, plan["row"]] += 1.0


def forward(q, k, v, group, **options):
    out, lse = honest_forward(q, k, v, group, **options)
    plant(out, group, "out")
    return out, lse


def backward(dout, q, k, v, out, lse, group, **options):
    dq, dk, dv = honest_backward(dout, q, k, v, out, lse, group, **options)
    plant(dq, group, "dq")
    plant(dk, group, "dk")
    return dq, dk, dv


burstcu.attention, burstcu.attention_backward = forward, backward
code = demo.main(plan["argv"])
codes = MPI.COMM_WORLD.gather(code)  # printed by rank 0 alone: lines of two ranks can interleave
if MPI.COMM_WORLD.Get_rank() == 0:
    print(f"exit codes of the ranks: {json.dumps(codes)}", flush=True)
sys.exit(code)
"""


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run_planted(world: int, quantity, row: int = 0, ranks=()):
    """The small job on `world` ranks with a wrong `quantity` row planted on `ranks`
    (quantity None: nothing planted)."""
    plan = {"quantity": quantity, "row": row, "ranks": list(ranks), "argv": SMALL_JOB}
    cmd = [mpiexec(), "-n", str(world), sys.executable, "-c", PLANTED_WRONG_ROW, json.dumps(plan)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())


def _verdicts(stdout: str) -> dict:
    """{rank: "PASSED" | "FAILED"} from the verdict lines, which end the report."""
    lines = [l for l in stdout.splitlines() if l.startswith("rank ") and ":" in l.split()[1]]
    return {int(l.split()[1].rstrip(":")): l.split()[2] for l in lines}


def _exit_codes(stdout: str) -> list:
    """What demo.main returned on each rank, in rank order."""
    prefix = "exit codes of the ranks: "
    return json.loads(next(l for l in stdout.splitlines() if l.startswith(prefix))[len(prefix):])


@pytest.mark.mpi
@pytest.mark.parametrize("world, extra", [(1, []), (3, []),
                                          (2, ["--layout", "zigzag", "--seqlen", "1003"])])
def test_demo_reports_every_rank(world, extra):
    """The table, the byte formula equal to the measured bytes, one verdict a rank; any length
    in either layout (zigzag on 1003 rows: shards of 502 and 501, odd)."""
    cmd = [mpiexec(), "-n", str(world), sys.executable, "-m", "burstcu.demo", *SMALL_JOB, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:1] == ["rank"])
    rows = [l.split() for l in lines[header + 1:header + 1 + world]]
    assert [int(r[0]) for r in rows] == list(range(world))
    formula = [l for l in lines if l.startswith("formula per rank")][0]
    fwd_formula = [int(x.replace(",", "")) for x in formula.split("= ")[1].split(" bytes")[0].split(" / ")]
    assert len(fwd_formula) == world
    bwd_formula = [int(x.replace(",", "")) for x in
                   formula.split("dqs*|dQ fp32| = ")[1].split(" bytes")[0].split(" / ")]
    for r in rows:
        errors = [float(x) for x in r[1:5]]
        assert max(errors) < 1e-4, r           # float32 against float64
        assert int(r[7].replace(",", "")) == fwd_formula[int(r[0])]
        assert int(r[9].replace(",", "")) == bwd_formula[int(r[0])]
    assert "checking against a float64 reference" in proc.stderr   # not silent meanwhile
    assert "FlashAttention's rule" in proc.stdout                   # says what it holds them to
    assert _verdicts(proc.stdout) == {r: "PASSED" for r in range(world)}
    assert lines[-world:] == [l for l in lines if l.startswith("rank ") and "PASSED" in l]


@pytest.mark.mpi
def test_demo_passes_on_every_rank_and_exits_zero():
    proc = _run_planted(2, None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(proc.stdout) == {0: "PASSED", 1: "PASSED"}, proc.stdout
    assert _exit_codes(proc.stdout) == [0, 0], proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("quantity, row", [("out", 101), ("dk", 0)])
def test_a_wrong_row_fails_every_rank(quantity, row):
    """A wrong row on every rank: out at a row inside the shard (every row of the checked heads
    is compared), dk at the shard's first row (a shard edge: always sampled)."""
    proc = _run_planted(2, quantity, row, ranks=(0, 1))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert _verdicts(proc.stdout) == {0: "FAILED", 1: "FAILED"}, output
    assert all(f"worst {quantity}: max |{quantity} - ref|" in l
               for l in proc.stdout.splitlines() if "FAILED" in l), output
    assert _exit_codes(proc.stdout) == [1, 1], output


@pytest.mark.mpi
def test_every_rank_exits_non_zero_when_one_rank_fails():
    """The verdict is agreed: rank 0's results are right, yet it exits 1 beside rank 1, whose
    dq is wrong at its last row (a shard edge; a wrong out would spoil every rank's dk, dv)."""
    proc = _run_planted(2, "dq", 191, ranks=(1,))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert _verdicts(proc.stdout) == {0: "PASSED", 1: "FAILED"}, output
    assert _exit_codes(proc.stdout) == [1, 1], output


@pytest.mark.mpi
def test_ranks_given_different_arguments_stop_on_every_rank():
    """Rank 1 given another --sample-rows sized its reference part otherwise, and the ranks'
    sum of parts came back garbage that passed its own check: every rank now names the
    argument and exits 2 before any work; the self-test too."""
    job = [sys.executable, "-m", "burstcu.demo", *SMALL_JOB]
    cmd = [mpiexec(), "-n", "1", *job, "--sample-rows", "8", ":", "-n", "1", *job, "--sample-rows", "12",
           ":", "-n", "1", *job, "--sample-rows", "8", "--layout", "contiguous"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = ("burstcu demo: the ranks were given different arguments (rank 1: --sample-rows 12 "
            "(rank 0: 8); rank 2: --layout 'contiguous' (rank 0: 'zigzag'))")
    assert proc.stderr.count(said) == 3, proc.stderr
    assert "PASSED" not in proc.stdout
    # a rank whose arguments argparse refuses stops before MPI's start no more: the others
    # waited there forever
    cmd = [mpiexec(), "-n", "1", *job, ":", "-n", "1", *job, "--kv-heads", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--kv-heads 3 must divide --heads 4" in proc.stderr
    assert "burstcu demo: rank(s) [1] stopped at their arguments (see the message there)" in proc.stderr
    # so does an unreadable $BURSTCU_TIMEOUT on one rank (the others waited out their timeout)
    cmd = [mpiexec(), "-n", "1", *job, ":", "-n", "1", "env", "BURSTCU_TIMEOUT=soon", *job]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "$BURSTCU_TIMEOUT" in proc.stderr and "stopped at their arguments" in proc.stderr
    # the self-test alike (--quick on one rank left the others waiting until the timeout)
    test = [sys.executable, "-m", "burstcu.selftest"]
    cmd = [mpiexec(), "-n", "1", *test, "--quick", ":", "-n", "1", *test]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("burstcu selftest: the ranks were given different arguments") == 2
    assert "--quick True (rank 0: False)" in proc.stderr or "--quick False (rank 0: True)" in proc.stderr


def test_sampled_rows_take_every_shard_edge_and_one_row_per_stride():
    positions = np.r_[0:10, 30:40]           # a zigzag shard: two runs of ten rows
    rows = demo.sampled_rows(positions, stride=4, rank=1)
    assert {0, 9, 10, 19} <= set(rows.tolist())
    for start in range(0, 20, 4):
        assert any(start <= r < start + 4 for r in rows), (start, rows)
    assert list(rows) == sorted(set(rows.tolist()))
    assert list(demo.sampled_rows(positions, stride=1, rank=1)) == list(range(20))


@pytest.mark.mpi
@pytest.mark.emulated
def test_demo_on_the_kernel_backend():
    """The same job on the CUDA kernels (CPU emulator): float16 by default, errors of fp16."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "burstcu.demo", "--seqlen", "128",
           "--heads", "2", "--headdim", "32", "--causal", "--backend", "emulated"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "float16" in proc.stdout
    lines = proc.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:1] == ["rank"])
    for row in (l.split() for l in lines[header + 1:header + 3]):
        assert max(float(x) for x in row[1:5]) < 1e-2, row
    assert _verdicts(proc.stdout) == {0: "PASSED", 1: "PASSED"}, proc.stdout


def test_demo_warms_up_before_timing(monkeypatch, capsys, count_calls):
    """One untimed pass (forward and backward) before the timed one, said so in the output."""
    # one process, no MPI
    monkeypatch.setattr(burstcu.group, "world_comm", lambda comm=None, timeout=None: None)
    forward = count_calls(demo.burstcu, "attention")
    backward = count_calls(demo.burstcu, "attention_backward")
    assert demo.main(["--seqlen", "32", "--heads", "2", "--headdim", "8", "--backend", "numpy"]) == 0
    assert (len(forward), len(backward)) == (2, 2)
    out = capsys.readouterr().out
    assert "untimed warm-up" in out
    header = out.splitlines().index(next(l for l in out.splitlines() if l.split()[:1] == ["rank"]))
    row = out.splitlines()[header + 1].split()
    assert max(float(x) for x in row[1:5]) < 1e-4
    assert out.splitlines()[-1].startswith("rank 0: PASSED")


@pytest.mark.parametrize("argv,said", [
    (["--heads", "0"], "--heads: must be at least 1, got 0"),
    (["--batch", "-1"], "--batch: must be at least 1, got -1"),
    (["--seqlen", "-64"], "--seqlen: must be at least 1"),
    (["--kv-heads", "0"], "--kv-heads: must be at least 1"),
    (["--kv-heads", "3"], "--kv-heads 3 must divide --heads 8"),
    (["--sample-rows", "-5"], "--sample-rows: must be at least 1"),
    (["--heads", "x"], "--heads: must be an int, got 'x'"),
])
def test_bad_demo_arguments_are_usage_errors(argv, said, capsys):
    """Sizes the demo cannot make: argparse's usage error (status 2), not a library traceback,
    under the name users type (it said `demo.py:`)."""
    with pytest.raises(SystemExit) as exc:
        demo.parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and said in err and "python -m burstcu.demo: error:" in err, err


def test_selftest_usage_errors_come_before_any_check(capsys):
    """--only without --full, and --json into a folder that does not exist: usage errors at once
    (they were a silently ignored option, and a FileNotFoundError after every check)."""
    from burstcu import selftest

    for argv, said in ((["--only", "variants"], "pass --full too"),
                       (["--quick", "--json", "/nonexistent/x.json"], "not a file in an existing folder"),
                       (["--quick", "--json", str(ROOT)], "not a file in an existing folder")):
        assert selftest.main(argv) == 2 and said in capsys.readouterr().err


def test_selftest_fails_an_op_wrong_over_several_tiles_or_in_float32(monkeypatch, capsys):
    """Its one correctness case (float64, causal, 32 rows a rank: one tile of the NumPy op) passed
    an op that folded only the first key tile of each block, and one whose float32 outputs were
    off by 0.05; the second case (float32, full, shards of several tiles) fails both."""
    from burstcu import selftest
    from burstcu.ops.numpy import op

    whole = op._tiles
    monkeypatch.setattr(op, "_tiles", lambda block, tile_q, tile_k, keys_outer=False: whole(
        block._replace(k_len=min(block.k_len, tile_k)), tile_q, tile_k, keys_outer))
    first, tiled = selftest.run_backend("numpy", quick=True)["correctness"]
    assert first["ok"] and not tiled["ok"] and "float32, full, contiguous" in tiled["case"], (first, tiled)
    monkeypatch.setattr(op, "_tiles", whole)
    finalize = op.NumpyOps.forward_finalize

    def shifted(self, state, out_dtype):
        out, lse = finalize(self, state, out_dtype)
        return (out if np.dtype(out_dtype) == np.float64 else out + np.float32(0.05)), lse
    monkeypatch.setattr(op.NumpyOps, "forward_finalize", shifted)
    first, tiled = selftest.run_backend("numpy", quick=True)["correctness"]
    assert first["ok"] and not tiled["ok"] and tiled["errors"]["out"] > 0.04, (first, tiled)
    monkeypatch.setattr(op.NumpyOps, "forward_finalize", finalize)
    assert selftest.main(["--quick"]) == 0 and capsys.readouterr().out.count("correctness: ok") == 2


def test_selftest_fails_where_a_gpu_is_found_but_its_backend_cannot_start(monkeypatch, capsys):
    """It said "no usable CUDA GPU on this machine" and PASSED (exit 0) when the GPU backend
    could not start (NCCL missing, a driver too old)."""
    from burstcu import selftest
    from burstcu.transport.bootstrap import BackendUnavailable

    real = selftest.run_backend

    def run_backend(backend, quick):
        if backend == "cupy":
            raise BackendUnavailable("burstcu backend 'cupy' cannot start (rank(s) 0): NCCL is missing")
        return real(backend, quick)
    monkeypatch.setattr(selftest, "gpu_usable", lambda: True)
    monkeypatch.setattr(selftest, "run_backend", run_backend)
    assert selftest.main(["--quick"]) == 1
    out = capsys.readouterr().out
    assert "[cupy] cannot start on the GPU found here" in out and "selftest FAILED" in out
    assert "no usable CUDA GPU" not in out


@pytest.mark.mpi
def test_a_rank_whose_rows_have_a_result_of_zero_passes():
    """Two rows, causal, two ranks: rank 0's one row sees one key, so its exact dq is 0 and its
    computed dq rounding noise. Judged at its own max|ref| (~1e-22) it FAILED by luck; the noise
    floor is the quantity's scale over every rank's rows."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "burstcu.demo", "--seqlen", "2",
           "--causal", "--backend", "numpy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _verdicts(proc.stdout) == {0: "PASSED", 1: "PASSED"}


@pytest.mark.mpi
@pytest.mark.parametrize("argv, said", [
    (["--seqlen", "1", "--backend", "numpy"], "--seqlen 1 on 2 ranks: a sequence of 1 positions"),
    (["--backend", "emulated", "--dtype", "float32"], "--dtype float32: the emulated backend computes"),
    (["--backend", "emulated", "--seqlen", "64", "--heads", "2", "--headdim", "512"],
     "the emulated backend: head dim 512 is not supported by the CUDA kernels"),
])
def test_what_the_backend_or_the_ranks_cannot_take_is_one_line(argv, said):
    """A dtype the backend does not compute, fewer rows than ranks, or a head dim its kernels do
    not take (a ValueError on every rank, status 1 as a FAILED run): status 2 on every rank and
    one line from rank 0 that says why, not a traceback on each."""
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "burstcu.demo", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=_env())
    assert proc.returncode == 2 and proc.stderr.count(f"burstcu demo: {said}") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
