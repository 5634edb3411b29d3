"""launch/: the commands burstcu-run and the SLURM example would run (dry runs), the per-rank GPU
binding script, and a real CPU run of the selftest through the launcher on 1 and 2 ranks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_run import burstcu_run_mpiexec

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"burstcu_launch_{name}", LAUNCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("run")


@pytest.mark.parametrize("flags, first", [
    (dict(isolated=0), "cwd"),                   # Python 3.10: no -P, no sys.flags.safe_path
    (dict(isolated=0, safe_path=False), "cwd"),
    (dict(isolated=0, safe_path=True), "kept"),  # python -P
    (dict(isolated=1, safe_path=True), "kept"),  # python -I
])
def test_mpi_first_puts_the_working_folder_first_on_every_supported_python(monkeypatch, tmp_path,
                                                                            flags, first):
    """launch/mpi_first.py read sys.flags.safe_path, which Python 3.11 added: under Python 3.10
    (requires-python >= 3.10) every rank launch/burstcu-run started ended in AttributeError."""
    import types

    mpi_first = _load("mpi_first")
    monkeypatch.setattr(sys, "flags", types.SimpleNamespace(**flags))
    monkeypatch.setattr(sys, "path", ["/a/script/folder", *sys.path[1:]])
    monkeypatch.chdir(tmp_path)
    mpi_first.working_folder_first()
    assert sys.path[0] == (os.getcwd() if first == "cwd" else "/a/script/folder")


def _cli(*args, env=None, unset=(), timeout=60):
    """Run the launcher with os.environ plus `env`, less the variables named in `unset`."""
    full_env = {k: v for k, v in os.environ.items() if k not in unset}
    proc = subprocess.run([str(LAUNCH / "burstcu-run"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(full_env, PYTHON=sys.executable, **(env or {})))
    return proc


# ---- pure command construction ----------------------------------------------------------------
def test_mpich_command_on_two_nodes():
    argv = run.mpi_command(mpiexec="mpiexec", flavour="mpich", nprocs=16, per_node=8, hosts=["a", "b"],
                           env={"NCCL_DEBUG": "WARN"}, bind="local-rank", command=["python", "t.py"])
    assert argv == ["mpiexec", "-n", "16", "-hosts", "a,b", "-ppn", "8", "-genv", "NCCL_DEBUG", "WARN",
                    str(LAUNCH / "rank-guard"), "python", str(LAUNCH / "mpi_first.py"), "t.py"]


def test_openmpi_command_with_visible_binding():
    argv = run.mpi_command(mpiexec="mpirun", flavour="openmpi", nprocs=8, per_node=4, hosts=["a", "b"],
                           env={"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"}, bind="visible",
                           command=["python", "t.py"])
    assert argv == ["mpirun", "-n", "8", "--host", "a:4,b:4", "--map-by", "ppr:4:node",
                    "-x", "NCCL_DEBUG=WARN", "-x", "NCCL_IB_DISABLE=1", str(LAUNCH / "rank-guard"),
                    str(LAUNCH / "bind-gpu"), "python", str(LAUNCH / "mpi_first.py"), "t.py"]


@pytest.mark.parametrize("nprocs,slots", [(4, 2), (5, 3), (1, 1)])
def test_openmpi_hosts_hold_every_rank_without_a_per_node_count(nprocs, slots):
    """`--cpu --hosts a,b -n 4` gave Open MPI `--host a:1,b:1`, two slots for four ranks, which
    it refuses: each host gets its share, rounded up."""
    argv = run.mpi_command(mpiexec="mpirun", flavour="openmpi", nprocs=nprocs, per_node=None,
                           hosts=["a", "b"], env={}, bind="local-rank", command=["python", "t.py"])
    assert argv[:5] == ["mpirun", "-n", str(nprocs), "--host", f"a:{slots},b:{slots}"]
    proc = _cli("--cpu", "-n", "4", "--hosts", "a,b", "--mpi", "openmpi", "--mpiexec", "mpirun",
                "--dry-run", "--", "python", "t.py")
    assert proc.returncode == 0 and "--host a:2,b:2 " in proc.stdout, proc.stdout + proc.stderr


def test_python_runs_with_mpi_initialised_first_once():
    first = str(LAUNCH / "mpi_first.py")
    assert run.with_mpi_first(["python3", "x.py"]) == ["python3", first, "x.py"]
    assert run.with_mpi_first(["python", "-m", "mpi4py", "x.py"]) == ["python", first, "x.py"]
    assert run.with_mpi_first(["./a.out", "x"]) == ["./a.out", "x"]
    assert run.with_mpi_first(["python", "-u", "-X", "dev", "t.py", "-u"]) == \
        ["python", "-u", "-X", "dev", first, "t.py", "-u"]
    assert run.with_mpi_first(["python", "-O", "-m", "pkg.main"]) == ["python", "-O", first, "-m", "pkg.main"]
    assert run.with_mpi_first(["python", "x.py"], root="launch") == ["python", "launch/mpi_first.py", "x.py"]


def test_python_after_env_assignments_runs_through_mpi_first_too():
    """`-- env A=1 python prog.py` skipped mpi_first.py without a word (a rank failing before
    burstcu.init then hung the others until the timeout) and kept a bare python unmapped."""
    first = str(LAUNCH / "mpi_first.py")
    assert run.with_mpi_first(["env", "A=1", "B=x=y", "python", "-u", "p.py"]) == \
        ["env", "A=1", "B=x=y", "python", "-u", first, "p.py"]
    assert run.with_mpi_first(["/usr/bin/env", "A=1", "/opt/bin/python3", "p.py"]) == \
        ["/usr/bin/env", "A=1", "/opt/bin/python3", first, "p.py"]
    assert run.with_python(["env", "A=1", "python3", "p.py"], "/venv/bin") == \
        ["env", "A=1", "/venv/bin/python3", "p.py"]
    for kept in (["env", "-i", "python", "p.py"], ["./a.out", "x"], ["env", "A=1"]):
        assert run.with_mpi_first(kept) == kept and run.mpi_first_note(kept) is not None
    assert run.mpi_first_note(["env", "A=1", "python", "p.py"]) is None
    proc = _cli("--cpu", "-n", "2", "--mpi", "mpich", "--mpiexec", "mpiexec", "--dry-run", "--",
                "./a.out", "x")
    assert proc.returncode == 0 and "without launch/mpi_first.py" in proc.stderr, proc.stderr
    proc = _cli("--cpu", "-n", "2", "--mpi", "mpich", "--mpiexec", "mpiexec", "--dry-run", "--",
                "env", "A=1", "python", "p.py")
    assert proc.returncode == 0 and "mpi_first.py" not in proc.stderr, proc.stderr
    assert proc.stdout.rstrip().endswith(f"env A=1 python {first} p.py"), proc.stdout


def test_mpi_first_runs_modules_scripts_and_code_with_mpi_initialised(tmp_path):
    """launch/mpi_first.py runs a script (its folder first on sys.path), `-m module` (the
    current folder first) and `-c code` as `python -m mpi4py` does, with MPI initialised
    before the program's first line."""
    probe = "from mpi4py import MPI; import sys; print(MPI.Is_initialized(), sys.argv[1:], sys.path[0])"
    (tmp_path / "prog.py").write_text(probe)
    (tmp_path / "mod_here.py").write_text(probe)
    for program in (["prog.py"], ["-m", "mod_here"], ["-c", probe]):
        proc = subprocess.run([sys.executable, str(LAUNCH / "mpi_first.py"), *program, "a", "b"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        initialised, rest = proc.stdout.strip().split(" ", 1)
        assert initialised == "True" and rest.startswith("['a', 'b']"), proc.stdout
        if program[0] != "-c":
            assert rest.endswith(str(tmp_path)), proc.stdout
    # mpi4py's -rc options still take effect: applied before MPI is initialised
    proc = subprocess.run([sys.executable, str(LAUNCH / "mpi_first.py"), "-rc", "thread_level=single",
                           "-c", "from mpi4py import MPI; print(MPI.Query_thread() == MPI.THREAD_SINGLE)"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stdout + proc.stderr


def test_rank_env_keeps_the_users_settings():
    assert run.rank_env(True, {}, {}) == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "1",
                                          "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert run.rank_env(False, {"NCCL_DEBUG": "INFO"}, {"NCCL_P2P_DISABLE": "1"}) == {"NCCL_P2P_DISABLE": "1"}


# ---- the CLI's dry run ------------------------------------------------------------------------
def test_dry_run_cpu():
    proc = _cli("--cpu", "-n", "2", "--mpi", "mpich", "--mpiexec", "mpiexec", "--dry-run", "--",
                "python", "-m", "burstcu.selftest", env={"NCCL_DEBUG": ""}, unset=run.CPU_ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("mpiexec -n 2 -genv MKL_NUM_THREADS 1 -genv OMP_NUM_THREADS 1 "
                                   f"-genv OPENBLAS_NUM_THREADS 1 {LAUNCH / 'rank-guard'} "
                                   f"python {LAUNCH / 'mpi_first.py'} -m burstcu.selftest")


def test_dry_run_gpu_one_node():
    proc = _cli("--gpus-per-node", "4", "--mpi", "openmpi", "--mpiexec", "mpirun", "--env",
                "NCCL_SOCKET_IFNAME=eth0", "--dry-run", "--", "python", "train.py", "--lr", "1e-3",
                env={"NCCL_DEBUG": "WARN"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("mpirun -n 4 --map-by ppr:4:node -x NCCL_SOCKET_IFNAME=eth0 "
                                   f"{LAUNCH / 'rank-guard'} python {LAUNCH / 'mpi_first.py'} train.py --lr 1e-3")


def test_refuses_more_ranks_than_gpus_and_missing_gpus():
    proc = _cli("-n", "9", "--gpus-per-node", "8", "--mpi", "mpich", "--dry-run", "--", "python", "x.py")
    assert proc.returncode != 0 and "one GPU per rank" in proc.stderr
    if run.detect_gpus() is None:
        proc = _cli("--dry-run", "--", "python", "x.py")
        assert proc.returncode != 0 and "--gpus-per-node" in proc.stderr


@pytest.mark.parametrize("given,message", [
    (["--nodes", "2", "--gpus-per-node", "8"], "--nodes 2 without --slurm: name the nodes with --hosts"),
    (["--nodes", "3", "--hosts", "a,b", "--gpus-per-node", "8"], "--nodes 3 but --hosts names 2 node(s)"),
    (["--cpu", "-n", "2", "--gpus-per-node", "1"], "--cpu: --gpus-per-node does not apply"),
    (["--cpu", "-n", "2", "--time", "01:00:00"], "--time applies to --slurm only"),
    (["--cpu", "-n", "2", "--partition", "gpu"], "--partition applies to --slurm only"),
    (["--cpu", "-n", "2", "--bind", "visible"], "--bind visible needs GPUs"),
    (["--cpu"], "--cpu: pass -n N"),
    (["--cpu", "-n", "2", "--env", "BAD KEY=1"], "--env 'BAD KEY=1': KEY=VALUE, KEY a variable name"),
    (["--cpu", "-n", "2", "--env", "1X=1"], "KEY a variable name"),
])
def test_options_a_run_would_ignore_or_that_contradict_are_usage_errors(given, message):
    """`--nodes 2 --gpus-per-node 8` ran 8 ranks, `--nodes 3 --hosts a,b` 2 nodes, and --time,
    --partition, --gpus-per-node with --cpu changed nothing: each is refused (usage error, 2)."""
    proc = _cli(*given, "--mpi", "mpich", "--mpiexec", "mpiexec", "--dry-run", "--", "python", "x.py")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_nodes_matching_the_hosts_is_accepted():
    proc = _cli("--nodes", "2", "--hosts", "a,b", "--gpus-per-node", "8", "--mpi", "mpich",
                "--mpiexec", "mpiexec", "--dry-run", "--", "python", "x.py")
    assert proc.returncode == 0 and proc.stdout.startswith("mpiexec -n 16 -hosts a,b -ppn 8 "), \
        proc.stdout + proc.stderr


@pytest.mark.parametrize("option", ["-n", "--gpus-per-node", "--nodes"])
def test_a_count_below_one_is_a_usage_error(option):
    """`--cpu -n -1` ran one rank and exited 0: a count below 1 is refused (usage error, 2)."""
    proc = _cli("--cpu", "-n", "2", option, "-1", "--mpi", "mpich", "--dry-run", "--", "python", "x.py")
    assert proc.returncode == 2 and f"{option} -1: at least 1" in proc.stderr, proc.stderr


# ---- SLURM ---------------------------------------------------------------------------------------
def test_slurm_example_is_the_rendered_template():
    """The example is what --slurm renders from the repository's .venv (README's install); run
    from another Python, --slurm maps python as `sbatch_python` says."""
    command = ["python", "-m", "burstcu.selftest"]
    rendered = run.render_sbatch(nodes=2, gpus_per_node=8, command=[".venv/bin/python", *command[1:]])
    assert (LAUNCH / "slurm_example.sbatch").read_text() == rendered
    proc = _cli("--slurm", "--nodes", "2", "--gpus-per-node", "8", "--", *command)
    assert proc.returncode == 0
    assert proc.stdout == run.render_sbatch(nodes=2, gpus_per_node=8, command=run.sbatch_python(command))
    if Path(sys.executable).parent.resolve() == (ROOT / ".venv" / "bin").resolve():
        assert proc.stdout == rendered   # README's install renders the example itself


def test_slurm_maps_a_bare_python_as_mpiexec_runs_do():
    """The batch script kept a bare `python` (the compute node's, without burstcu) where the
    mpiexec command runs the venv's: from the repository's .venv it is `.venv/bin/python`,
    relative to the submit directory as launch/ is; from another venv, its absolute path."""
    venv_bin = Path(sys.executable).parent
    if sys.prefix == sys.base_prefix or not (venv_bin / "python").exists():
        pytest.skip("the tests do not run in a virtual environment")
    own = venv_bin.resolve() == (ROOT / ".venv" / "bin").resolve()
    want = ".venv/bin/python" if own else str(venv_bin / "python")
    assert run.sbatch_python(["python", "t.py"]) == [want, "t.py"]
    assert run.sbatch_python(["env", "A=1", "python", "t.py"]) == ["env", "A=1", want, "t.py"]
    assert run.sbatch_python(["/opt/python", "t.py"]) == ["/opt/python", "t.py"]
    assert run.sbatch_python(["python", "t.py"], root="/elsewhere") == [str(venv_bin / "python"), "t.py"]


def test_slurm_example_dry_run_prints_srun():
    proc = subprocess.run(["bash", str(LAUNCH / "slurm_example.sbatch")], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=dict(os.environ, BURSTCU_DRY_RUN="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ("srun --mpi=pmix --cpu-bind=cores launch/rank-guard "
                                   ".venv/bin/python launch/mpi_first.py -m burstcu.selftest")


@pytest.mark.parametrize("value", ["0", "false", ""])
def test_slurm_dry_run_off_runs_srun(value, tmp_path):
    """BURSTCU_DRY_RUN=0 (or false, or empty) runs srun: the script took any non-empty value for
    a dry run, so a job meant to run printed its srun line and ended 0, having run nothing."""
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\necho "srun ran with $#"\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(LAUNCH / "slurm_example.sbatch")], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=dict(os.environ, BURSTCU_DRY_RUN=value,
                                                         PATH=f"{tmp_path}:{os.environ['PATH']}"))
    assert proc.returncode == 0 and proc.stdout.strip() == "srun ran with 7", proc.stdout + proc.stderr


@pytest.mark.parametrize("given", [["-n", "3"], ["--cpu"], ["--mpi", "mpich"], ["--mpiexec", "mpirun"],
                                   ["--dry-run"]])
def test_slurm_refuses_options_it_would_ignore(given):
    """--slurm renders --nodes x --gpus-per-node ranks that srun starts, and runs nothing: -n,
    --cpu, --mpi, --mpiexec and --dry-run were dropped without a word (usage error, 2)."""
    proc = _cli("--slurm", "--nodes", "2", "--gpus-per-node", "8", *given, "--", "python", "t.py")
    assert proc.returncode == 2 and f"--slurm: {given[0]} does not apply" in proc.stderr, proc.stderr


def test_slurm_hosts_are_the_nodelist():
    """--slurm --hosts a,b,c set only --nodes=3: the job now runs on those nodes."""
    proc = _cli("--slurm", "--hosts", "a,b,c", "--gpus-per-node", "8", "--", "python", "t.py")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=3\n#SBATCH --nodelist=a,b,c\n" in proc.stdout, proc.stdout
    proc = _cli("--slurm", "--nodes", "2", "--hosts", "a,b,c", "--gpus-per-node", "8", "--", "python", "t.py")
    assert proc.returncode == 2 and "--nodes 2 but --hosts names 3 node(s)" in proc.stderr, proc.stderr


def test_slurm_env_values_are_quoted_and_override_the_job(tmp_path):
    """--env values went into the script unquoted (a quote broke it, `$(...)` ran, a key with a
    space was a bad substitution) and only as defaults: now quoted, over the job's environment
    as under mpiexec, and a key that is no variable name is refused."""
    values = {"QUOTE": 'a "x', "SUBST": "$(echo INJECTED >&2)", "NCCL_DEBUG": "INFO", "EMPTY": ""}
    args = [a for key, value in values.items() for a in ("--env", f"{key}={value}")]
    proc = _cli("--slurm", "--gpus-per-node", "1", *args, "--", "python", "t.py")
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(proc.stdout)
    fake = tmp_path / "srun"   # runs nothing: prints the environment the ranks would get
    fake.write_text('#!/bin/sh\nfor k in QUOTE SUBST NCCL_DEBUG EMPTY; do printenv "$k" || echo "-"; done\n')
    fake.chmod(0o755)
    ran = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30, cwd=ROOT,
                         env=dict(os.environ, NCCL_DEBUG="TRACE", QUOTE="from the job",
                                  PATH=f"{tmp_path}:{os.environ['PATH']}"))
    assert ran.returncode == 0 and "INJECTED" not in ran.stderr, ran.stderr
    assert ran.stdout.split("\n")[:4] == list(values.values()), ran.stdout
    proc = _cli("--slurm", "--gpus-per-node", "1", "--env", "BAD KEY=1", "--", "python", "t.py")
    assert proc.returncode == 2 and "KEY a variable name" in proc.stderr, proc.stderr
    with pytest.raises(ValueError, match="shell names"):
        run.render_sbatch(nodes=1, gpus_per_node=1, command=["python", "t.py"], env={"A-B": "1"})


def test_slurm_visible_binding_and_partition():
    text = run.render_sbatch(nodes=4, gpus_per_node=4, command=["python", "t.py"], partition="gpu",
                             bind="visible", env={"NCCL_IB_HCA": "mlx5_0"})
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --ntasks-per-node=4" in text
    assert "export NCCL_IB_HCA=mlx5_0\n" in text
    assert text.rstrip().endswith("srun --mpi=pmix --cpu-bind=cores launch/rank-guard launch/bind-gpu "
                                  "python launch/mpi_first.py t.py")


# ---- per-rank GPU binding --------------------------------------------------------------------
@pytest.mark.parametrize("env,expected", [
    ({"MPI_LOCALRANKID": "1"}, "1"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "6"),
    ({"SLURM_LOCALID": "0", "CUDA_VISIBLE_DEVICES": "3"}, "3"),
    # srun's per-task binding (--gpus-per-task=1): each task sees its one GPU
    ({"SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "3"}, "3"),
])
def test_bind_gpu_picks_the_local_ranks_gpu(env, expected):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                          "PMIX_LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}
    proc = subprocess.run([str(LAUNCH / "bind-gpu"), "sh", "-c",
                           'echo "$CUDA_VISIBLE_DEVICES $BURSTCU_GPU_BOUND"'],
                          capture_output=True, text=True, timeout=30, env=dict(clean, **env))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [expected, "1"]


def test_bind_gpu_errors():
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMIX_LOCAL_RANK")}
    proc = subprocess.run([str(LAUNCH / "bind-gpu"), "true"], capture_output=True, text=True,
                          timeout=30, env=clean)
    assert proc.returncode == 2 and "no node-local rank" in proc.stderr
    proc = subprocess.run([str(LAUNCH / "bind-gpu"), "true"], capture_output=True, text=True, timeout=30,
                          env=dict(clean, MPI_LOCALRANKID="3", CUDA_VISIBLE_DEVICES="0,1"))
    assert proc.returncode == 2 and "lists fewer GPUs" in proc.stderr


@pytest.mark.parametrize("visible,message", [("5", "lists fewer GPUs"), ("5,6", "lists fewer GPUs"),
                                             ("", "set and empty: no GPU is visible")])
@pytest.mark.parametrize("inside_slurm", [False, True])
def test_bind_gpu_refuses_a_list_shorter_than_the_local_ranks(visible, message, inside_slurm):
    """One entry in CUDA_VISIBLE_DEVICES gave that GPU to every local rank (`cut -f3` prints a
    line without commas whole), and an empty one (no GPU visible) read as unset; mpiexec inside
    a SLURM job (whose SLURM_LOCALID the ranks inherit) is no srun per-task binding either."""
    local_rank = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "PMIX_LOCAL_RANK")
    clean = {k: v for k, v in os.environ.items() if k not in local_rank}
    slurm = {"SLURM_LOCALID": "0"} if inside_slurm else {}
    proc = subprocess.run([str(LAUNCH / "bind-gpu"), "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"],
                          capture_output=True, text=True, timeout=30,
                          env=dict(clean, MPI_LOCALRANKID="2", CUDA_VISIBLE_DEVICES=visible, **slurm))
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr


# ---- rank-guard ----------------------------------------------------------------------------------
@pytest.mark.parametrize("status,message", [
    (200, "exited with status 200 ("), (137, "died of signal 9, or exited with status 137 (")])
def test_rank_guard_names_a_status_no_signal_gives_as_a_status(status, message, tmp_path):
    """Status 200 read as "died of signal 72": only 129..192 may be a signal (sh cannot tell)."""
    proc = subprocess.run([str(LAUNCH / "rank-guard"), "sh", "-c", f"exit {status}"], capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == status and message in proc.stderr, proc.stderr


def test_rank_guard_removes_the_folders_of_guards_gone(tmp_path):
    """A guard ended by SIGKILL leaves its state folder (no trap runs): the next guard on the
    host removes this user's folders whose guard is gone, and keeps a live guard's."""
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f"burstcu-rank-guard.{dead.pid}.{host}.abcdef"
    live = tmp_path / f"burstcu-rank-guard.{os.getpid()}.{host}.abcdef"
    other_host = tmp_path / f"burstcu-rank-guard.{dead.pid}.x{host}.abcdef"
    for folder in (gone, live, other_host):
        folder.mkdir()
    proc = subprocess.run([str(LAUNCH / "rank-guard"), "true"], capture_output=True, text=True,
                          timeout=30, env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name])


@pytest.mark.mpi
def test_a_failed_job_leaves_no_state_folder_behind(tmp_path):
    """MPICH ends the ranks of a failed job with SIGKILL: every rank-guard left its folder in
    $TMPDIR, one a rank a failed job. The next job's guards remove them."""
    script = ("from mpi4py import MPI; import time\n"
              "if MPI.COMM_WORLD.Get_rank() == 1: raise SystemExit('rank 1 fails')\n"
              "time.sleep(60)\n")
    env = {"TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = _cli(*burstcu_run_mpiexec(), "--cpu", "-n", "2", "--", sys.executable, "-c", script, env=env,
                timeout=120)
    assert proc.returncode != 0 and "rank 1 fails" in proc.stderr, proc.stdout + proc.stderr
    proc = _cli(*burstcu_run_mpiexec(), "--cpu", "-n", "1", "--", sys.executable, "-c", "pass", env=env,
                timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("burstcu-rank-guard.")] == []


# ---- a real run through the launcher: the selftest on the CPU ---------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2])
def test_selftest_through_the_launcher(world):
    proc = _cli(*burstcu_run_mpiexec(), "--cpu", "-n", str(world), "--", sys.executable, "-m",
                "burstcu.selftest", "--quick",
                env={"PYTHONPATH": str(ROOT)}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("selftest PASSED") == 1  # rank 0 reports
    if run.detect_gpus() is None:
        assert "no usable CUDA GPU on this machine: ran the CPU checks only" in out
    assert f"[numpy over {'mpi' if world > 1 else 'self'}, {world} rank(s)] correctness: ok" in out
    if world > 1:
        assert "ring exchange" in out and "overlap" in out


def test_a_missing_mpiexec_is_named_with_the_way_out():
    """Without the venv's mpiexec (or one on PATH), a clear message instead of a traceback."""
    proc = _cli("--cpu", "-n", "2", "--mpi", "mpich", "--mpiexec", "/nonexistent/mpiexec", "--",
                "python", "x.py")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "no mpiexec found" in proc.stderr and "'mpi' extra" in proc.stderr


def test_a_bare_python_runs_the_launchers_interpreter_beside_its_mpiexec(tmp_path):
    """`-- python prog.py` from a venv whose mpiexec the launcher uses: the ranks run that venv's
    Python (the one with mpi4py), as with the venv activated; a path or another mpiexec keeps
    the command as written. The wrapper picks the repository's .venv when $PYTHON is unset."""
    venv_bin = Path(sys.executable).parent
    beside = str(venv_bin / "mpiexec")
    if not Path(beside).exists():
        pytest.skip("no mpiexec beside this Python")
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    assert run.ranks_python(["python", "x.py"], beside) == [str(venv_bin / "python"), "x.py"]
    assert run.ranks_python(["python3", "-m", "m"], beside) == [str(venv_bin / "python3"), "-m", "m"]
    if (venv_bin / version).exists():
        assert run.ranks_python([version, "x.py"], beside) == [str(venv_bin / version), "x.py"]
    relative = os.path.relpath(beside)            # the same mpiexec, written otherwise
    assert run.ranks_python(["python", "x.py"], relative) == [str(venv_bin / "python"), "x.py"]
    assert run.ranks_python(["python", "x.py"], "/usr/bin/mpiexec") == ["python", "x.py"]
    assert run.ranks_python(["/opt/py/bin/python", "x.py"], beside) == ["/opt/py/bin/python", "x.py"]
    assert run.ranks_python(["pythonista", "x.py"], beside) == ["pythonista", "x.py"]
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv in the repository for the wrapper to pick")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX")}
    env["PATH"] = "/usr/bin:/bin"            # no venv on PATH or activated: the wrapper finds it
    proc = subprocess.run([str(LAUNCH / "burstcu-run"), "--cpu", "-n", "2", "--dry-run", "--",
                           "python", "x.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    venv_bin = (ROOT / ".venv" / "bin").resolve()
    words = proc.stdout.split()
    assert Path(words[0]).resolve() == venv_bin / "mpiexec", proc.stdout
    assert any(Path(w).parent.resolve() == venv_bin and Path(w).name.startswith("python")
               for w in words[1:]), proc.stdout


def test_the_wrapper_started_through_a_link_finds_run_py(tmp_path):
    """A link to launch/burstcu-run (in ~/bin, say) looked for run.py beside the link."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "burstcu-run").symlink_to(LAUNCH / "burstcu-run")
    (tmp_path / "run").symlink_to(Path("bin") / "burstcu-run")   # a relative link to the link
    for link in (tmp_path / "bin" / "burstcu-run", tmp_path / "run"):
        proc = subprocess.run([str(link), "--cpu", "-n", "2", "--mpi", "mpich", "--mpiexec", "mpiexec",
                               "--dry-run", "--", "python", "x.py"], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=dict(os.environ, PYTHON=sys.executable))
        assert proc.returncode == 0 and str(LAUNCH / "rank-guard") in proc.stdout, proc.stderr


def test_an_activated_environment_wins_over_the_repositorys_venv(tmp_path):
    """With a venv or conda environment activated, the wrapper runs python3 from PATH (that
    environment's), not the repository's .venv."""
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 to stand for the activated environment's")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH="/usr/bin:/bin", VIRTUAL_ENV=str(tmp_path))
    proc = subprocess.run([str(LAUNCH / "burstcu-run"), "--cpu", "-n", "2", "--dry-run", "--",
                           "python", "x.py"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert ".venv" not in proc.stdout, proc.stdout
