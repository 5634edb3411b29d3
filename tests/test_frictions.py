"""What a new user meets first: the extras that bench/ and the compile gate need (and the line
that names them when they are missing), `deterministic=` on every backend, the head dims the
docs promise, the emulator's word about its first compile, and the decode example checking
itself.

Missing packages are made missing for one subprocess: a finder placed first on sys.meta_path
refuses them before the program under test starts (`run_without`).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import numpy as np
import pytest

import burstcu
from burstcu.build.decode_variants import DPLS
from burstcu.build.fwd_variants import SM90_HEADDIMS
from burstcu.build.variants import NATIVE_HEADDIMS
from burstcu.ops.cuda import KernelOps
from burstcu.ops.numpy import NumpyOps
from burstcu.transport.bootstrap import gpu_usable
from tests.mpi_run import run_mpi

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
BENCH_INSTALL = "pip install 'burstcu[bench]'"
CUDA_INSTALL = "pip install 'burstcu[cuda13]'"

# the program run by run_without: refuse `blocked` (and its submodules), then run `target` as
# `python -m MODULE ARGS` or `python FILE ARGS` would
_WITHOUT = textwrap.dedent("""
    import runpy, sys
    blocked, kind, target, args = {blocked!r}, {kind!r}, {target!r}, {args!r}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in blocked:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    sys.argv = [target, *args]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")
""")


def run_without(blocked: tuple[str, ...], kind: str, target: str, args: list,
                timeout: float = 120, **env) -> subprocess.CompletedProcess:
    """Run `target` (kind "module": a module name; "file": a script path) with `args` in a
    subprocess where the top-level packages `blocked` cannot be imported."""
    program = _WITHOUT.format(blocked=blocked, kind=kind, target=target, args=list(map(str, args)))
    environment = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                       PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=environment)


# ------------------------------------------------------------------------------------------------
# 1. the bench extra, and --plot without matplotlib

# imports bench/ may make beyond the core dependencies and the bench extra: each is guarded
# (an ImportError drops a comparison) or needed only by --backend cupy and gpu/, whose own
# extras install them
OPTIONAL_IN_BENCH = {"torch": "torch", "jax": "jax", "cupy": "cuda13", "cuda": "cuda13"}
# import name -> distribution, where they differ
DISTRIBUTION = {"ml_dtypes": "ml_dtypes", "mpi4py": "mpi4py"}


def _requirement_names(requirements: list[str], seen: frozenset = frozenset()) -> set[str]:
    """The distribution names of `requirements`, an extra of burstcu itself ("burstcu[mpi]")
    replaced by that extra's names."""
    names = set()
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0).lower()
        extras = re.search(r"\[([^\]]+)\]", requirement)
        if name == "burstcu" and extras:
            for extra in (e.strip() for e in extras.group(1).split(",")):
                if extra not in seen:
                    names |= _requirement_names(PYPROJECT["project"]["optional-dependencies"][extra],
                                                seen | {extra})
        else:
            names.add(name)
    return names


def _bench_imports() -> dict[str, list[str]]:
    """Top-level packages imported by bench/**/*.py other than the standard library, burstcu and
    bench itself -> the files importing each."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top not in sys.stdlib_module_names and top not in ("burstcu", "bench"):
                    found.setdefault(top, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_bench_extra_installs_what_bench_imports():
    extras = PYPROJECT["project"]["optional-dependencies"]
    core = _requirement_names(PYPROJECT["project"]["dependencies"])
    bench = _requirement_names(extras["bench"])
    assert {"matplotlib", "mpi4py", "mpich"} <= bench, bench
    missing = {}
    for module, files in _bench_imports().items():
        if module in OPTIONAL_IN_BENCH:
            assert OPTIONAL_IN_BENCH[module] in extras, (module, OPTIONAL_IN_BENCH[module])
        elif DISTRIBUTION.get(module, module).lower() not in core | bench:
            missing[module] = files
    assert not missing, f"bench/ imports these, neither a core dependency nor in the bench extra: {missing}"


def test_the_code_needs_no_newer_python_than_pyproject_admits():
    """launch/mpi_first.py read sys.flags.safe_path, which Python 3.11 added, where pyproject
    admits 3.10: every rank launch/burstcu-run started there ended in AttributeError. vermin reads
    the library, launch/ and bench/ against requires-python (the tests may use newer Python)."""
    pytest.importorskip("vermin")
    lowest = re.fullmatch(r">=\s*(3\.\d+)", PYPROJECT["project"]["requires-python"]).group(1)
    argv = [f"-t={lowest}-", "--violations", "--no-tips", "--eval-annotations", "burstcu",
            "launch/run.py", "launch/mpi_first.py", "bench"]
    proc = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", *argv],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"needs a newer Python than {lowest}:\n{proc.stdout}{proc.stderr}"


def test_bench_readme_says_how_to_install_the_extra():
    text = (ROOT / "bench" / "README.md").read_text()
    assert "pip install -e '.[bench]'" in text
    assert BENCH_INSTALL in text


def test_plot_without_matplotlib_stops_before_measuring(tmp_path):
    """A bench script given --plot where matplotlib is missing ends at once, saying what to
    install: no table (nothing measured), no traceback, no picture."""
    picture = tmp_path / "decode.png"
    proc = run_without(("matplotlib",), "file", "bench/decode.py",
                       ["--cache", "64", "--prefill", "64", "--heads", "2", "--kv-heads", "1",
                        "--headdim", "16", "--repeats", "1", "--plot", picture])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert BENCH_INSTALL in proc.stderr and "matplotlib" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "" and not picture.exists()


def test_without_plot_a_bench_script_runs_without_matplotlib(tmp_path):
    """Only --plot needs matplotlib: the same script without it runs (its model-only mode)."""
    proc = run_without(("matplotlib",), "file", "bench/decode.py",
                       ["--predict", "--ranks", "1", "2", "--cache", "1024"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PREDICTION" in proc.stdout


# ------------------------------------------------------------------------------------------------
# 2. the compile gate without the CUDA extra

def test_the_gate_without_cuda_python_names_the_extra():
    """`python -m burstcu.build check` where cuda-python cannot be imported: one line naming the
    extra to install, a non-zero exit, no traceback from the worker processes."""
    proc = run_without(("cuda",), "module", "burstcu.build",
                       ["check", "--arch", "sm_80", "--family", "nonfinite_flag"])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert CUDA_INSTALL in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------------------------------------
# 3. deterministic= on every backend; unknown options refused

@pytest.mark.parametrize("backend", ["numpy", "emulated",
                                     pytest.param("cupy", marks=pytest.mark.gpu)])
def test_init_takes_deterministic_on_every_backend(backend):
    if backend == "cupy" and not gpu_usable():
        pytest.skip("no usable CUDA GPU")
    with burstcu.init(backend=backend, deterministic=True) as group:
        assert group.ops.deterministic is True


def test_the_numpy_op_takes_deterministic_and_stays_deterministic():
    """NumpyOps is bitwise deterministic at any thread count: it takes deterministic= either
    way and says True."""
    assert NumpyOps(deterministic=False).deterministic is True
    assert NumpyOps(deterministic=True).deterministic is True


@pytest.mark.parametrize("backend, takes", [("numpy", "tile_q, tile_k, threads, deterministic"),
                                            ("emulated", "arch, deterministic, randomize")])
def test_an_unknown_option_names_the_options_the_backend_takes(backend, takes):
    with pytest.raises(TypeError, match=f"unknown option 'determinstic': it takes {takes}$"):
        burstcu.init(backend=backend, determinstic=True)


@pytest.mark.parametrize("backend, options, kind, message", [
    ("numpy", {"threads": 1.5}, TypeError, "threads must be an int, got 1.5"),
    ("numpy", {"tile_q": 2.5}, TypeError, "tile_q must be an int"),
    ("numpy", {"threads": -1}, ValueError, "threads must be at least 1, got -1"),
    ("numpy", {"tile_k": 0}, ValueError, "tile_k must be at least 1"),
    ("numpy", {"deterministic": "yes"}, TypeError, "deterministic must be True or False"),
    ("emulated", {"randomize": 1}, TypeError, "randomize must be True or False"),
])
def test_a_bad_option_value_is_refused_at_init(backend, options, kind, message):
    """An option of the wrong type or range fails at init (on every rank: its agreement round),
    not at the first call on the ranks that passed it."""
    with pytest.raises(kind, match=message):
        burstcu.init(backend=backend, **options)
    with burstcu.init(backend="numpy", threads=None, tile_q=np.int64(32)) as group:
        assert group.ops.tile_q == 32 and group.ops.threads >= 1


def test_init_documents_deterministic():
    doc = burstcu.init.__doc__
    assert "deterministic" in doc and "every backend" in doc


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2])
def test_an_unknown_option_on_one_rank_fails_on_every_rank(world):
    results = run_mpi(world, "friction_bodies:unknown_option_on_one_rank_fails_on_every_rank",
                      timeout=120)
    assert [r["ranks_failed"] for r in results] == [world] * world
    results = run_mpi(world, "friction_bodies:bad_option_value_on_one_rank_fails_on_every_rank",
                      timeout=120)
    assert [r["ranks_failed"] for r in results] == [world] * world


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2])
def test_ranks_that_read_other_kernel_sources_fail_at_init_on_every_rank(world):
    """Each rank compiled the kernels its own folder held: ranks on nodes with different
    checkouts (or one with $BURSTCU_KERNEL_DIR set) ran different kernels, and their results
    differed without a word."""
    results = run_mpi(world, "friction_bodies:ranks_reading_other_kernel_sources_fail_on_every_rank",
                      timeout=120)
    for r in results:
        if world == 1:             # one rank: nothing to disagree with (its own copy is its kernels)
            assert r["messages"] == {}, r
            continue
        said = r["messages"]["changed"]
        assert said.startswith("burstcu.init: ranks read different kernel sources: rank 0 "), said
        assert f"rank {world - 1} /" in said and "burstcu-kernels-" in said, said
        assert "the same $BURSTCU_KERNEL_DIR" in said, said


# ------------------------------------------------------------------------------------------------
# 4. docs/backends.md: head dims and deterministic

def _backends_section() -> str:
    """docs/backends.md, the page that says which head dims and options each backend takes."""
    return (ROOT / "docs" / "backends.md").read_text()


def _listed(numbers) -> str:
    """(32, 64, 96) -> "32, 64 and 96", as the docs write a list."""
    *head, last = map(str, numbers)
    return f"{', '.join(head)} and {last}"


def test_the_readme_states_the_head_dims_the_kernels_take():
    section = _backends_section()
    ops = KernelOps("emulated")
    runs = [d for d in range(0, 513) if ops.headdim_problem(d) is None]
    assert f"take {min(runs)}..{max(runs)}" in section
    assert runs == list(range(min(runs), max(runs) + 1))
    assert _listed(NATIVE_HEADDIMS) in section
    assert f"(`\"sm_90a\"`) has {_listed(SM90_HEADDIMS)}" in section
    assert _listed(32 * dpl for dpl in DPLS) in section
    assert "`numpy` takes any" in section


def test_the_readme_states_deterministic_on_every_backend():
    section = _backends_section()
    assert "deterministic=True)` is accepted on every backend" in section


# ------------------------------------------------------------------------------------------------
# 5. the emulator's first compile

TINY_CU = """
__global__ void tiny_a(int* p) { p[threadIdx.x] = 1; }
__global__ void tiny_b(int* p) { p[threadIdx.x] = 2; }
"""
# builds tiny_a twice (the second from the cache) and then tiny_b (a second compile)
_BUILD_TWICE = """
import sys
from burstcu.build.emulate import build_module
for names in (["tiny_a"], ["tiny_a"], ["tiny_b"]):
    build_module([sys.argv[1]], names)
"""


@pytest.mark.emulated
def test_the_emulator_says_once_that_it_compiles_and_how_long_it_took(tmp_path):
    source = tmp_path / "tiny.cu"
    source.write_text(TINY_CU)
    env = dict(os.environ, BURSTCU_CACHE_DIR=str(tmp_path / "cache"), BURSTCU_EMU_PCH="0")
    env.pop("BURSTCU_BUILD_TIMEOUT", None)

    def stderr_of_a_run() -> str:
        proc = subprocess.run([sys.executable, "-c", _BUILD_TWICE, str(source)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    cold = stderr_of_a_run()
    assert cold.count("compiling the CUDA kernels for the CPU") == 1, cold
    assert "first compile takes a while" in cold, cold
    assert len(re.findall(r"compiled tiny_a for the CPU in \d+\.\d s", cold)) == 1, cold
    assert "tiny_b" not in cold, cold                      # once a process
    warm = stderr_of_a_run()
    assert "burstcu: compil" not in warm, warm             # cache hits say nothing


# ------------------------------------------------------------------------------------------------
# 6. examples/decode_numpy.py checks itself

@pytest.fixture
def decode_example():
    """examples/decode_numpy.py as a module of its own (not on sys.path)."""
    spec = importlib.util.spec_from_file_location("decode_example", ROOT / "examples" / "decode_numpy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_example_shows_the_mpi4py_launch(decode_example):
    assert "mpiexec -n N python -m mpi4py examples/decode_numpy.py" in decode_example.__doc__


def test_the_decode_example_passes_its_own_check(decode_example, capsys):
    assert decode_example.main(["--prompt", "9", "--new", "4"]) == 0
    out = capsys.readouterr().out
    assert "matches the float64 reference" in out and f"tolerance {decode_example.TOLERANCE:g}" in out


def test_the_decode_example_refuses_what_it_cannot_do(decode_example, monkeypatch, capsys):
    """--new 0 generated one token and passed its check (it compared as many tokens as came
    out); a generator that gives fewer tokens than asked now fails the check."""
    with pytest.raises(SystemExit):
        decode_example.main(["--new", "0"])
    assert "--new 0: generate at least 1 token" in capsys.readouterr().err
    honest = decode_example.generate
    monkeypatch.setattr(decode_example, "generate",
                        lambda *a, **k: tuple(x[:-1] for x in honest(*a, **k)))   # one short
    assert decode_example.main(["--prompt", "9", "--new", "4"]) == 1
    assert "differ from the reference's" in capsys.readouterr().err


@pytest.mark.parametrize("spoil", ["attention", "token"])
def test_the_decode_example_fails_on_a_mismatch(decode_example, monkeypatch, capsys, spoil):
    """A decode output off by 1e-6 (above the float64 tolerance), or a different token: exit
    status 1, the error and the tolerance on stderr."""
    honest = decode_example.generate

    def spoiled(*args, **kwargs):
        tokens, attended = honest(*args, **kwargs)
        if spoil == "attention":
            attended[-1] = attended[-1] + 1e-6
        else:
            tokens[-1] = (tokens[-1] + 1) % decode_example.VOCAB
        return tokens, attended

    monkeypatch.setattr(decode_example, "generate", spoiled)
    assert decode_example.main(["--prompt", "9", "--new", "4"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH against the float64 reference" in err, err
    assert f"tolerance {decode_example.TOLERANCE:g}" in err, err
    if spoil == "attention":
        assert re.search(r"= 1e-06 over 4 steps", err), err
    else:
        assert "differ from the reference's" in err, err


def test_import_leaves_ml_dtypes_out_and_dtype_names_still_work():
    """`import burstcu` does not import ml_dtypes (most of a second, paid by every rank of a
    job), yet every door that takes a dtype name knows "bfloat16" in a fresh process: plan,
    KVCache, the schedule checker's recording, the reference's rounding; NumPy knows the name only
    once ml_dtypes is imported, which the first name that needs it does."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import burstcu
        from burstcu.testing import reference, schedule
        assert "ml_dtypes" not in sys.modules, "imported by burstcu"
        p = burstcu.plan((1, 64, 4, 16), (1, 64, 4, 16), dtype="bfloat16")
        c = burstcu.KVCache(None, 1, 4, 1, 8, "bfloat16")
        schedule.record("forward", 2, 0, causal=True, layout="zigzag", dtype="bfloat16")
        x = np.full((1, 4, 1, 8), 1 + 2.0**-9, np.float32)
        out = reference.attention_ref(x, x, x, dtype=np.float32, round_to="bfloat16")[0]
        print(c.k.dtype, float(burstcu.ops.base.finfo(c.k.dtype).eps), float(out.max()))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["bfloat16", str(2.0**-7), "1.0"]    # 1 + 2^-9 rounds to 1
