"""Which way imports run: the library's modules import each other in no circle, its run path never
imports its verification package; and only `burstcu/group.py`, which picks the backend, asks
which one it is.

`burstcu.testing` (references, the loopback runner, the schedule checker, the self-test checks)
sits above the library like `numpy.testing`; only the checking entry points users run
(`burstcu.selftest`, and `burstcu.demo`, which checks its result against the float64
reference) may import it. Read from the sources (every import statement, relative or
absolute, at any depth), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import burstcu

PACKAGE = Path(burstcu.__file__).resolve().parent
VERIFICATION = {"testing", "selftest.py", "demo.py"}  # may import burstcu.testing: the checking
#                                                      entry points users run


def imported_modules(path: Path) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1]  # the package a relative import counts from (also for __init__.py)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_runtime_module_imports_the_verification_package():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in VERIFICATION:
            continue
        hits = [m for m in imported_modules(path) if m == "burstcu.testing" or m.startswith("burstcu.testing.")]
        if hits:
            offenders.append(f"{path.relative_to(PACKAGE.parent)}: {sorted(set(hits))[0]}")
    assert not offenders, offenders


def test_the_scan_sees_relative_imports():
    """The scanner itself: kernel_ops's relative import of the emulator build resolves to its
    absolute name (a scanner that missed relative imports would pass anything)."""
    names = imported_modules(PACKAGE / "ops" / "cuda" / "kernel_ops.py")
    assert "burstcu.build.emulate" in names
    assert any(n.startswith("burstcu.testing") for n in imported_modules(PACKAGE / "selftest.py"))


def module_name(path: Path) -> str:
    """burstcu/ops/base.py -> "burstcu.ops.base"; a package's __init__.py -> the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_imports(path: Path, modules: set) -> set:
    """The library modules `path` imports, lazily or not, but not under `if TYPE_CHECKING:`
    (never run): `from . import api` names burstcu.api, not the package that holds it."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(branch.test) for n in ast.walk(branch)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = parts[:len(parts) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" for alias in node.names]
            names = names if all(n in modules for n in names) else [module]
        for name in names:
            while name and name not in modules:     # an attribute of a module: that module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found - {module_name(path)}


def test_no_import_circles():
    """Each floor imports only the floors below it: following the imports from any module
    never leads back to it (docs/repository.md)."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    imports = {m: library_imports(p, set(paths)) for m, p in paths.items()}
    circles = []
    for start in imports:
        trail, seen = [(start, [start])], set()
        while trail:
            here, way = trail.pop()
            for there in sorted(imports[here]):
                if there == start:
                    circles.append(" -> ".join(way + [start]))
                elif there not in seen:
                    seen.add(there)
                    trail.append((there, way + [there]))
    assert not circles, circles[:4]
    assert "burstcu.validate" in imports["burstcu.api"], "the scan follows relative imports"
    assert "burstcu.ops.cuda.kernel_ops" in imports["burstcu.ops.cuda"], "and a package's own"


def backend_tests(path: Path) -> list[str]:
    """Every comparison in `path` of a name or attribute called `backend` with a string
    ("backend == 'cupy'", "self.backend != 'emulated'", "backend in ('numpy', ...)")."""
    def is_backend(x) -> bool:
        return (isinstance(x, ast.Name) and x.id == "backend") or (isinstance(x, ast.Attribute)
                                                                     and x.attr == "backend")

    def has_string(x) -> bool:
        return any(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in ast.walk(x))

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_backend(s) for s in sides) and any(has_string(s) for s in sides if not is_backend(s)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_group_asks_which_backend_runs():
    """Strategies, ops, transports and adapters act on what a backend can do (its device, array
    module, dtypes): only group.py, which picks the backend, compares a backend's name with a
    string. (The CUDA op, which serves two backends, looks its own name up in two tables, its
    arrays' device and its tensor maps' encoder; table lookups are not what this looks for.)"""
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path.name != "group.py"
                 for hit in backend_tests(path)]
    assert not offenders, offenders
    assert backend_tests(PACKAGE / "group.py"), "the scan finds group.py's own comparisons"
