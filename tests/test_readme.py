"""README.md's test command is the one CI runs, and the API it documents exists."""

import re
from pathlib import Path

import pytest

import burstcu

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_the_readme_test_command():
    readme = _commands((ROOT / "README.md").read_text())
    assert len(readme) >= 2, "README must show the main-job command and the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme[1] in ci, f"README test command {readme[1]!r} is not what .ci/run runs"


def test_main_job_command_runs_the_demo_under_mpiexec():
    main = _commands((ROOT / "README.md").read_text())[0]
    assert "mpiexec -n 4" in main and "burstcu.demo" in main


def test_documented_api_exists():
    for name in ("init", "attention", "attention_backward", "shard", "unshard", "Group"):
        assert hasattr(burstcu, name)


def _run_block(heading: str, tmp_path) -> str:
    """The first python block after `heading` in README.md, copied verbatim, run under
    mpiexec -n 2; its stdout (the run must succeed)."""
    import os
    import subprocess
    import sys

    from tests.mpi_run import mpiexec

    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    block = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)[0]
    program = tmp_path / "example.py"
    program.write_text(block + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", str(program)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_usage_example_runs_as_written(tmp_path):
    """README's "Using it" block runs under mpiexec -n 2 and every rank gets the whole output back."""
    out = _run_block("## Using it", tmp_path)
    for rank in (0, 1):
        assert f"rank {rank}: out (1, 4096, 8, 64), sent " in out, out


def test_the_jax_example_runs_as_written(tmp_path):
    pytest.importorskip("jax")
    out = _run_block("### JAX", tmp_path)
    for rank in (0, 1):
        assert f"rank {rank}: dq (1, 512, 4, 32) of dQ (1, 1024, 4, 32), ArrayImpl" in out, out


def test_the_pytorch_example_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    out = _run_block("### PyTorch", tmp_path)
    for rank in (0, 1):
        assert f"rank {rank}: q.grad (1, 512, 4, 32) of dQ (1, 1024, 4, 32)" in out, out


def test_every_package_directory_ships_in_the_wheel():
    """pyproject's package list names every directory of burstcu/ that holds Python modules (an
    editable install hides a missing one; a wheel would lack it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "burstcu").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
