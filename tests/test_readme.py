"""README.md's test command is the one CI runs, and the API it documents exists."""

import re
from pathlib import Path

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
