"""README.md and docs/*.md say what is true: the README's test command is the one CI runs, every
python block runs as written under mpiexec -n 2 (torchrun for a torch.distributed one) and prints
what its page says, every bash block names files and modules that exist, and every link between
the pages leads somewhere."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import burstcu

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)\n```[ \t]*$", flags=re.S | re.M)


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(lang: str) -> list[tuple[str, int, str]]:
    """(page, n, code) of every ```lang block of the pages, n counting that page's lang blocks."""
    found = []
    for page in PAGES:
        codes = [code for tag, code in FENCE.findall(page.read_text()) if tag.strip() == lang]
        found += [(_name(page), n, code) for n, code in enumerate(codes)]
    return found


def _prose(text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", text)


def _commands(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


# ------------------------------------------------------------------------------------------------
# the two commands

def test_ci_runs_the_readme_test_command():
    readme = _commands((ROOT / "README.md").read_text())
    assert len(readme) >= 2, "README must show the main-job command and the test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme[1] in ci, f"README test command {readme[1]!r} is not what .ci/run runs"


def test_main_job_command_runs_the_demo_under_mpiexec():
    main = _commands((ROOT / "README.md").read_text())[0]
    assert "mpiexec -n 4" in main and "burstcu.demo" in main


def test_documented_api_exists():
    for name in ("init", "attention", "attention_backward", "shard", "unshard", "Group", "Sharding",
                 "decode", "KVCache", "linear_attention", "linear_attention_backward", "plan",
                 "Link", "SameShardsWarning", "HeadsAxisWarning", "CallSiteWarning", "CommTimeoutError",
                 "PeerFailedError", "BlockMask"):
        assert hasattr(burstcu, name), name


def test_the_readme_example_is_short_and_uses_sharding():
    (code,) = [code for page, _, code in _blocks("python") if page == "README.md"]
    assert len(code.splitlines()) <= 15 and "burstcu.Sharding(" in code


# ------------------------------------------------------------------------------------------------
# every python block runs as written

# What each python block prints, by (page, n: its index among the page's python blocks). A line
# with "{rank}" must appear once for each of ranks 0 and 1; "..." stands for any text within the
# line. A python block without an entry here fails test_every_python_block_has_an_expectation.
EXPECTED = {
    ("README.md", 0): [
        "rank {rank}: out (1, 4096, 8, 64), sent ... bytes in ... messages",
    ],
    ("docs/adapters.md", 0): [
        "rank {rank}: dq (1, 512, 4, 32) of dQ (1, 1024, 4, 32), ArrayImpl",
    ],
    ("docs/adapters.md", 1): [
        "rank {rank}: q.grad (1, 512, 4, 32) of dQ (1, 1024, 4, 32)",
    ],
    ("docs/api.md", 0): [
        "rank {rank}: out (512, 4, 32) bfloat16, lse (4, 512) float32, dq (512, 4, 32) bfloat16, "
        "global lse (4, 1024)",
    ],
    ("docs/decode.md", 0): [
        "rank 0: out (1, 1, 8, 64), 502 rows here, matches one process: True",
        "rank 1: out (1, 1, 8, 64), 501 rows here, matches one process: True",
    ],
    ("docs/layouts.md", 0): [
        "rank 0: q (1, 300, 4, 32), lse (1, 4, 300), matches one process: True",
        "rank 1: q (1, 724, 4, 32), lse (1, 4, 724), matches one process: True",
    ],
    ("docs/layouts.md", 1): [
        "rank {rank}: 3632 pairs kept, matches one process: True",
    ],
    ("docs/layouts.md", 2): [
        "rank 0: q (1, 501, 4, 32), out (1, 501, 4, 32), matches one process: True",
        "rank 1: q (1, 500, 4, 32), out (1, 500, 4, 32), matches one process: True",
    ],
    ("docs/layouts.md", 3): [
        "rank 0: q (1, 505, 4, 32), matches one process: True",
        "rank 1: q (1, 495, 4, 32), matches one process: True",
    ],
    ("docs/launching.md", 0): [
        "rank {rank} of 2: out (1, 2048, 8, 64) over torch.distributed, sent ... bytes",
    ],
    ("docs/linear.md", 0): [
        "rank {rank}: out (1, 512, 4, 32), dk (1, 512, 2, 32), matches one process: True",
    ],
    ("docs/numerics.md", 0): [
        "rank {rank}: rows 0..999 finite: True, rows 1000..1023 NaN: True",
    ],
    ("docs/strategies.md", 0): [
        "rank 0: burst sent 1048576 bytes in 1 messages, correct: True",
        "rank 1: burst sent 0 bytes in 0 messages, correct: True",
        "rank {rank}: ring sent 1048576 bytes in 2 messages, correct: True",
        "rank {rank}: allgather sent 1048576 bytes in 1 messages, correct: True",
        "rank {rank}: ulysses sent ... bytes in ... messages, correct: True",
        "rank {rank}: usp sent ... bytes in ... messages, correct: True",
        "rank {rank}: auto sent ... bytes in ... messages, correct: True",
        "PREDICTION (cpu...G=2 B=1 S=1024 a rank, H=8/2 D=64; choice: ",
    ],
    ("docs/troubleshooting.md", 0): [
        "rank {rank}: ValueError: ...rank 1 holds 1024 rows...did it pass the global array instead "
        "of its shard?",
    ],
    ("docs/troubleshooting.md", 1): [
        "rank {rank}: ValueError: rank {rank}: attention_backward(check=True): the probabilities "
        "recomputed from lse sum to ...not 1",
    ],
}

# blocks for processes torchrun starts (`torchrun --standalone --nproc_per_node 2`), not mpiexec
UNDER_TORCHRUN = {("docs/launching.md", 0)}

PYTHON_BLOCKS = _blocks("python")


def test_every_python_block_has_an_expectation():
    found = {(page, n) for page, n, _ in PYTHON_BLOCKS}
    assert found == set(EXPECTED), (f"python blocks without an expectation: {sorted(found - set(EXPECTED))}; "
                                    f"expectations without a block: {sorted(set(EXPECTED) - found)}")


def _line_pattern(expected: str) -> re.Pattern:
    return re.compile("[^\n]*?".join(map(re.escape, expected.split("..."))))


def _run(code: str, tmp_path, torchrun: bool = False) -> str:
    """`code`, copied verbatim to a file, run under mpiexec -n 2 python -m mpi4py (or, with
    `torchrun`, torchrun --standalone --nproc_per_node 2); its stdout (the run must succeed)."""
    from tests import mpi_run

    program = tmp_path / "example.py"
    program.write_text(code + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    env.pop("PYTHONUNBUFFERED", None)   # each rank's lines leave in one write: no interleaving
    command = ([mpi_run.torchrun(), "--standalone", "--nproc_per_node", "2", str(program)]
               if torchrun else [mpi_run.mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
                                 str(program)])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                              env=env)
    except subprocess.TimeoutExpired as exc:   # what it printed says where it stopped
        said = [x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                for x in (exc.stdout, exc.stderr)]
        pytest.fail(f"{' '.join(command)} hung for 180 s; it printed:\n{said[0]}\n{said[1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("page, n, code", PYTHON_BLOCKS, ids=[f"{p}:{n}" for p, n, _ in PYTHON_BLOCKS])
@pytest.mark.mpi
def test_the_python_block_runs_as_written(page, n, code, tmp_path):
    for framework in ("jax", "torch"):
        if re.search(rf"^\s*(import|from) {framework}\b", code, flags=re.M):
            pytest.importorskip(framework)
    out = _run(code, tmp_path, torchrun=(page, n) in UNDER_TORCHRUN)
    for expected in EXPECTED[(page, n)]:
        for line in ([expected.replace("{rank}", str(r)) for r in (0, 1)] if "{rank}" in expected
                     else [expected]):
            assert _line_pattern(line).search(out), f"{page} block {n}: no line {line!r} in\n{out}"


# ------------------------------------------------------------------------------------------------
# bash blocks and prose name what exists

TOP = {p.name for p in ROOT.iterdir()} - {".venv", ".git"}
MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _exists(path: str) -> bool:
    """A repository path, which may hold a glob (`*`) or a brace list (`{a,b}`)."""
    braces = re.search(r"\{([^{}]*)\}", path)
    if braces:
        return all(_exists(path[:braces.start()] + alt + path[braces.end():])
                   for alt in braces.group(1).split(","))
    return bool(glob.glob(str(ROOT / path))) if "*" in path else (ROOT / path).exists()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:          # a parent package that does not exist
        return False


def _named(code: str) -> tuple[list[str], list[str]]:
    """(modules run with `python -m`, repository paths) that a bash block names."""
    modules, paths = [], []
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        for i, token in enumerate(tokens):
            after_python = i >= 2 and Path(tokens[i - 2]).name.startswith("python")
            after_mpi4py = i >= 3 and tokens[i - 3:i - 1] == ["-m", "mpi4py"]   # -m mpi4py -m X
            runs_module = i >= 1 and tokens[i - 1] == "-m" and (after_python or after_mpi4py)
            if runs_module and MODULE.fullmatch(token):
                modules.append(token)
            elif "/" in token and token.split("/")[0] in TOP:
                paths.append(token)
    return modules, paths


def test_the_bash_check_reads_modules_and_paths():
    modules, paths = _named('OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py '
                            '-m burstcu.demo --causal && python -m pytest -m "not slow" -q \\\n'
                            '  bench/cpu/overlap.py train.py  # a comment: launch/none')
    assert modules == ["mpi4py", "burstcu.demo", "pytest"] and paths == ["bench/cpu/overlap.py"]


@pytest.mark.parametrize("page, n, code", _blocks("bash"), ids=[f"{p}:{n}" for p, n, _ in _blocks("bash")])
def test_the_bash_block_names_what_exists(page, n, code):
    modules, paths = _named(code)
    missing = [m for m in modules if not _importable(m)]
    missing += [p for p in paths if not _exists(p)]
    assert not missing, f"{page} bash block {n} names what does not exist: {missing}"


def test_every_code_block_says_what_it_is():
    """python (runs, above), bash (checked above) or text: nothing untagged."""
    for page in PAGES:
        tags = {tag.strip() for tag, _ in FENCE.findall(page.read_text())}
        assert tags <= {"python", "bash", "text"}, f"{_name(page)}: code blocks tagged {tags}"


def test_every_repository_path_in_the_prose_exists():
    pattern = re.compile(r"(?<![\w./-])((?:bench|burstcu|docs|examples|kernels|launch|tests|\.ci)"
                         r"/[\w./*{},-]*)")
    missing = []
    for page in PAGES:
        for path in pattern.findall(_prose(page.read_text())):
            path = path.rstrip(".,")
            if not _exists(path):
                missing.append(f"{_name(page)}: {path}")
    assert not missing, missing


# ------------------------------------------------------------------------------------------------
# links between the pages

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", _prose(page.read_text()), flags=re.M)}


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{_name(page)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{_name(page)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# ------------------------------------------------------------------------------------------------

def test_every_package_directory_ships_in_the_wheel():
    """pyproject's package list names every directory of burstcu/ that holds Python modules (an
    editable install hides a missing one; a wheel would lack it)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "burstcu").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
