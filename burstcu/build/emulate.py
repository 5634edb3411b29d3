"""Run the project's CUDA kernel sources on the CPU: build them with g++ against the emulator
(`kernels/emu/cuda_emu.h`) and launch them with CuPy ``RawKernel``'s calling convention.

    mod = build_module(["flash_bwd.cu"], ["flash_bwd_delta<__half>"])
    fn = mod.get_function("flash_bwd_delta<__half>")
    fn((blocks,), (128,), (params,))      # params: a numpy.void, e.g. launch.bwd_delta_params(...)

How it works: `build_module` writes a small C++ file that includes the emulator, the sources and one
``BURSTCU_EMU_REGISTER`` line per name expression (the emulator's equivalent of NVRTC name
expressions), compiles it with ``g++ -O1 -shared`` (with a precompiled header of the emulator, built
once), links the emulator's runtime object into it (``kernels/emu/emu_entry.h``: the C entry points,
the scheduler and the sm_90 machinery, built once per option set, so that a module's build makes
code for its own kernels alone) and loads the ``.so`` with ctypes. The ``.so`` is cached on disk
under a hash of everything that decides its contents (the sources, every header under ``kernels/``,
name expressions, options, compiler version), so each module is built once and later loads cost
nothing; a file lock plus an atomic rename make concurrent builds by many ranks safe. On a cold
cache the precompiled header and the runtime object come first: the first build takes ~15 s in all,
each further kernel about a second. The first time a process runs g++ it says so on stderr, and then
how long that build took (`_FirstCompileNotice`); cache hits print nothing. Cache folder: the
``emu/`` subfolder of the kernel cache (`burstcu.build.compile.cache_dir`), under the same rules as
the rest of it (the module docstring of `burstcu.build.compile`): a folder only this user can
change, a ``.so`` loaded only when its sha256 matches its manifest (else rebuilt, with a warning),
and every g++ run and lock wait bounded by $BURSTCU_BUILD_TIMEOUT.

Arguments: numpy arrays are passed as their data pointer (contiguity is the kernel's business:
strides are passed explicitly), ``None`` as a null pointer, numpy scalars by value, and a
structured scalar (``numpy.void``, e.g. a parameter struct from `burstcu.ops.cuda.params`) as the bytes
of a C++ struct passed by value, as CuPy passes it. Python ``int`` and ``float`` are refused,
because their C width would be a guess; the emulator checks each argument's size and kind
(pointer / signed / unsigned / float / bool / struct) against the kernel's C++ signature.

`struct_layout` reports how g++ lays out a C++ type of the sources (sizeof, alignof, offsetof of
named members): the host mirrors of the parameter structs are checked against it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .compile import (atomic_write, build_timeout, built_from_sources, run_bounded, trusted_dir,
                      verified_entry)
from .compile import cache_dir as kernel_cache_dir
from .variants import kernel_dir

__all__ = ["EmuModule", "EmuFunction", "build_module", "cache_dir", "struct_layout"]

# Bump when the generated file or the flags change in a way the hash would not see.
_FORMAT_VERSION = "3"
_CXX = os.environ.get("BURSTCU_EMU_CXX", "g++")
# -O1: builds take about 30% less time than at -O2 (the kernel tests compile a few hundred
# modules on a fresh machine) and the modules run the tests as fast (measured on 2 cores)
_BASE_FLAGS = (
    "-std=c++17", "-O1", "-shared", "-fPIC", "-fstack-clash-protection", "-Wno-unknown-pragmas",
    "-DBURSTCU_EMU",
)
# NVRTC options that mean nothing on the CPU.
_IGNORED_PREFIXES = (
    "--gpu-architecture", "-arch", "--std", "-std", "--use_fast_math", "-use_fast_math", "-lineinfo",
    "--generate-line-info", "-default-device", "--device-as-default-execution-space", "-Xptxas",
    "--fmad", "-fmad", "--extra-device-vectorization", "-dopt",
)
_PASSED_PREFIXES = ("-D", "-U", "-I", "-O", "-g")

# One launch at a time in this process: the emulator's fault handlers are process-wide.
_LAUNCH_LOCK = threading.Lock()
# The modules whose fibers (two memory mappings each, up to 2048 a module) stay mapped, least
# recently launched first: past POOLS_KEPT the oldest gives them back (emu_release; mapping them
# again costs it a few ms at its next launch), so that a process loading many modules stays far
# below the kernel's limit on mappings (vm.max_map_count, 65530) instead of failing an mmap
# somewhere, and launches that take turns among a few modules map nothing: a training step
# (forward and backward, masked, on either table) launches from 7 or 8, so 12 are kept (at most
# 49152 mappings; a module of 256-thread blocks keeps 512). Fewer than a step's made every launch
# of every step map and unmap its fibers anew (a thousand mmaps a backward).
POOLS_KEPT = 12
_POOL_HOLDERS: "OrderedDict[int, ctypes.CDLL]" = OrderedDict()
_LOADED: dict[str, "EmuModule"] = {}
_LOADED_LOCK = threading.Lock()

_SCALAR_KIND = {"i": "i", "u": "u", "f": "f", "b": "b", "V": "s"}

# Set once this process has warned that builds run without the precompiled header.
_PCH_WARNED = threading.Event()
_PCH_FILES = ("emu_pch.h", "emu_pch.h.gch")


def cache_dir() -> Path:
    """Where built modules (``.so``), runtime objects and precompiled headers live: ``emu/`` under the
    kernel cache (`compile.cache_dir`), trusted like it (`compile.trusted_dir`). RuntimeError
    when its file system is mounted noexec (a common setting for /tmp): the modules built there
    could not be loaded."""
    folder = trusted_dir(kernel_cache_dir() / "emu")
    if os.statvfs(folder).f_flag & os.ST_NOEXEC:
        raise RuntimeError(f"the kernel cache folder {folder} is on a file system mounted noexec, where "
                           f"the emulator's modules, built there, may not run. Fix: set "
                           f"BURSTCU_CACHE_DIR to a folder of yours on a file system that allows it "
                           f"(under $HOME, say)")
    return folder


class _FirstCompileNotice:
    """Two lines on stderr, once per process: before the first g++ run, that the emulator is
    compiling the kernels for the CPU and that it takes a while; when the build that needed it
    is done, how long it took. A process whose builds all come from the cache prints nothing.

    `starting()` runs before each g++ run (the precompiled header's, the runtime object's, a
    module's); `finished()`
    after each build, and speaks only on the thread that announced, once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self._thread: int | None = None
        self._done = False

    def starting(self) -> None:
        with self._lock:
            if self._started is not None:
                return
            self._started, self._thread = time.perf_counter(), threading.get_ident()
        _say(f"burstcu: compiling the CUDA kernels for the CPU (the emulator, with {_CXX}): the "
             f"first compile takes a while (~15 s), each further kernel about a second; later "
             f"runs load them from {cache_dir()}")

    def finished(self, what: str) -> None:
        with self._lock:
            if self._done or self._thread != threading.get_ident():
                return
            self._done = True
            seconds = time.perf_counter() - self._started
        _say(f"burstcu: compiled {what} for the CPU in {seconds:.1f} s")


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


_FIRST_COMPILE = _FirstCompileNotice()


@lru_cache(maxsize=None)
def _compiler_version() -> str:
    try:
        out = run_bounded([_CXX, "--version"])
    except OSError as e:
        raise RuntimeError(f"the emulator needs a C++17 compiler ({_CXX}): {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"the emulator needs a C++17 compiler: `{_CXX} --version` failed "
                           f"(exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return out.stdout.splitlines()[0] if out.stdout else _CXX


def _translate_options(options: Sequence[str]) -> list[str]:
    flags = []
    for opt in options:
        if opt.startswith(_PASSED_PREFIXES):
            flags.append(opt)
        elif not opt.startswith(_IGNORED_PREFIXES):
            raise ValueError(
                f"option {opt!r} has no meaning for the CPU emulator; pass -D/-U/-I/-O/-g options "
                f"or NVRTC-only ones ({', '.join(_IGNORED_PREFIXES[:4])}, ...), which are ignored"
            )
    return flags


def _generated_source(sources: Sequence[Path], names: Sequence[str]) -> str:
    lines = ["// generated by burstcu/build/emulate.py", '#include "emu/cuda_emu.h"']
    lines += [f'#include "{p}"' for p in sources]
    for name in names:
        if '"' in name or "\\" in name or "\n" in name:
            raise ValueError(f"invalid name expression {name!r}")
        lines.append(f'BURSTCU_EMU_REGISTER("{name}", ({name}));')
    return "\n".join(lines) + "\n"


def _cache_key(sources: Sequence[Path], text: str, flags: Sequence[str], kdir: Path) -> str:
    h = hashlib.sha256()
    for part in (_FORMAT_VERSION, _compiler_version(), " ".join(flags), text):
        h.update(part.encode())
        h.update(b"\0")
    # Every header under kernels/ (what the sources may include); other .cu files only when listed.
    headers = sorted(p for p in kdir.rglob("*") if p.suffix in (".h", ".cuh", ".hpp") and p.is_file())
    for p in list(sources) + headers:
        h.update(str(p).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:32]


# the emulator's settings from the environment: (variable, what it takes, its check); the C
# runtime reads the last two itself (kernels/emu/emu_launch.h), with atof / atol
_SWITCH = {"0": False, "false": False, "no": False, "off": False,
           "1": True, "true": True, "yes": True, "on": True}
_SETTINGS = (
    ("BURSTCU_EMU_PCH", "1 or 0 (true/false, yes/no, on/off)", lambda v: v.lower() in _SWITCH),
    ("BURSTCU_EMU_TIMEOUT_S", "seconds a launch may run, a number >= 0 (0: no limit)",
     lambda v: re.fullmatch(r"\+?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", v) is not None
     and math.isfinite(float(v))),
    ("BURSTCU_EMU_STACK_KB", "KB of each emulated thread's stack, a positive integer",
     lambda v: re.fullmatch(r"\+?[0-9]+", v) is not None and int(v) > 0),
)


def check_environment() -> None:
    """ValueError naming the first of the emulator's environment variables (`_SETTINGS`) set to
    what it does not take: the C runtime would read junk as 0 (no watchdog, or the default
    stack) without a word."""
    for name, takes, good in _SETTINGS:
        raw = os.environ.get(name)
        if raw is not None and not good(raw.strip()):
            raise ValueError(f"{name}={raw!r}: it takes {takes} (or leave it unset)")


def _precompiled_header(kdir: Path) -> Path | None:
    """A GCC precompiled header of emu/cuda_emu.h, built once per emulator version: it takes
    parsing the standard library and the emulator off every build (a quarter of a module's build).
    Returns the stub to force-include, or None (no PCH: slower, same result, and a warning once
    per process). A PCH whose digest does not match its manifest is rebuilt, never used."""
    check_environment()
    if not _SWITCH[os.environ.get("BURSTCU_EMU_PCH", "1").strip().lower()]:
        return None
    digest = _emulator_digest(kdir)
    folder = trusted_dir(cache_dir() / f"pch-{digest[:24]}")
    try:
        verified_entry(folder, "emu_pch", _PCH_FILES, lambda: _build_pch(kdir, folder),
                       sources_unchanged=lambda: _emulator_digest(kdir) == digest)
    except subprocess.CalledProcessError as exc:
        _warn_pch_once(f"g++ could not build the precompiled header in {folder} "
                       f"({exc.stderr.strip()[-2000:]})")
        return None
    with contextlib.suppress(OSError):   # gone meanwhile, or a read-only cache
        os.utime(folder)   # used now: not stale (`_remove_stale`), whoever cleans up
    return folder / _PCH_FILES[0]


def _emulator_digest(kdir: Path, flags: Sequence[str] = ()) -> str:
    """sha256 (hex) of what the emulator's own code depends on: the headers under kernels/emu/
    (the precompiled header and the runtime object hold these and nothing else: they include no
    other local header, which tests/kernels/test_kernel_cache.py checks), the compiler, the base
    flags and `flags`."""
    h = hashlib.sha256()
    for part in (_FORMAT_VERSION, _compiler_version(), " ".join(_BASE_FLAGS), " ".join(flags), str(kdir)):
        h.update(part.encode() + b"\0")
    for p in sorted((kdir / "emu").glob("*.h")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _runtime_object(kdir: Path, flags: Sequence[str], pch: Path | None) -> Path:
    """The emulator's runtime object for modules built with `flags`: kernels/emu/emu_entry.h (the
    C entry points and the sm_90 hooks, and through them the scheduler, the fault handling and
    the sm_90 machinery) compiled once, with the modules' own options so that both sides of the
    link see the same headers, and linked into each module. A module's translation unit then
    makes code only for what its kernels call: its build takes about half the time of one that
    compiles the runtime as well. Cached in `cache_dir()` under the rules of the modules."""
    folder, key = cache_dir(), f"runtime-{_emulator_digest(kdir, flags)[:32]}"
    target = folder / f"{key}.o"
    verified_entry(folder, key, [target.name],
                   lambda: _gxx('#include "emu/emu_entry.h"\n', [f for f in _BASE_FLAGS if f != "-shared"]
                                + [f"-I{kdir}", *flags, "-c"], [], target, pch),
                   sources_unchanged=lambda: f"runtime-{_emulator_digest(kdir, flags)[:32]}" == key)
    with contextlib.suppress(OSError):   # gone meanwhile, or a read-only cache
        os.utime(target)   # used now: not stale (`_remove_stale`)
    return target


def _build_pch(kdir: Path, folder: Path) -> None:
    """Write the stub header and its .gch into `folder` (each atomically); CalledProcessError
    when g++ fails."""
    stub, gch = (folder / name for name in _PCH_FILES)
    _FIRST_COMPILE.starting()
    atomic_write(stub, f'#include "{kdir / "emu" / "cuda_emu.h"}"\n'.encode())
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{gch.name}.", suffix=".tmp")
    os.close(fd)
    try:
        cmd = [_CXX, *(f for f in _BASE_FLAGS if f != "-shared"), f"-I{kdir}",
               "-x", "c++-header", str(stub), "-o", tmp]
        proc = run_bounded(cmd)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        os.replace(tmp, gch)  # atomic: readers see the old file or the whole new one
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _warn_pch_once(reason: str) -> None:
    """Warn, the first time in this process, that emulator builds run without the precompiled
    header (a third longer each), and why."""
    if not _PCH_WARNED.is_set():
        _PCH_WARNED.set()
        warnings.warn(f"emulator builds run without the precompiled header, each a third longer: "
                      f"{reason}", stacklevel=3)


def _remove_stale(keep: Sequence[Path], max_age_s: float = 86400.0) -> None:
    """Each emulator version leaves a ~50 MB PCH and a runtime object per option set: drop those
    (but `keep`) made or used more than a day ago. A runtime object that another process still
    needs is made again (`_built`); a PCH removed under a build costs it a retry without (`_gxx`).
    What builds killed midway left (their `.build-*` folders and `*.tmp` files: a PCH's is
    ~65 MB) goes too once a day old, older than any build lasts."""
    now = time.time()
    folder = cache_dir()
    for old in [*folder.glob("pch-*"), *folder.glob("runtime-*.o"), *folder.glob(".build-*"),
                *folder.glob("*.tmp"), *folder.glob("pch-*/*.tmp")]:
        with contextlib.suppress(OSError):   # gone meanwhile, or a read-only cache: left for later
            if old in keep or now - old.stat().st_mtime <= max_age_s:
                continue
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                if old.suffix == ".o":    # a runtime object's manifest first: never a bare one
                    old.with_suffix(".manifest").unlink(missing_ok=True)
                old.unlink()


def _gxx(source: str, flags: Sequence[str], inputs: Sequence[Path], target: Path,
         pch: Path | None) -> None:
    """Compile the C++ `source` with `flags`, then `inputs` (objects to link), into `target`
    (atomically), with the precompiled header `pch` when there is one; g++'s message on failure
    (RuntimeError)."""
    _FIRST_COMPILE.starting()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        cpp = Path(tmp) / "unit.cpp"
        cpp.write_text(source)
        out = Path(tmp) / target.name
        # -lrt: timer_create (the watchdog) lives there before glibc 2.34
        cmd = [_CXX, *flags, str(cpp), *map(str, inputs), "-o", str(out)] + (["-lrt"] if inputs else [])
        proc = None
        if pch:  # a PCH removed under our feet (cache cleanup) costs a retry without it, not an error
            proc = run_bounded(cmd[:1] + ["-Winvalid-pch", "-include", str(pch)] + cmd[1:])
            if proc.returncode == 0 and "-Winvalid-pch" in proc.stderr:  # built, without the PCH
                said = [line.strip() for line in proc.stderr.splitlines() if "-Winvalid-pch" in line]
                _warn_pch_once(f"g++ did not use {pch}.gch: {said[0]}")
        if proc is None or proc.returncode != 0:
            retry = run_bounded(cmd)
            if proc is not None and retry.returncode == 0:  # the PCH was the trouble, not the source
                _warn_pch_once(f"g++ failed with {pch}, not without it: {proc.stderr.strip()[-2000:]}")
            proc = retry
        if proc.returncode != 0:
            raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{proc.stderr[-8000:]}")
        os.replace(out, target)  # atomic: readers see the old file or the whole new one


def _source_paths(sources: Sequence[str | Path], kdir: Path) -> list[Path]:
    """Each source as an absolute path: a relative one is looked up in `kdir` first, then the cwd."""
    paths = []
    for s in sources:
        p = Path(s)
        if not p.is_absolute():
            p = (kdir / p) if (kdir / p).exists() else p.resolve()
        if not p.is_file():
            raise FileNotFoundError(f"kernel source {s} not found (looked in {kdir} and the cwd)")
        paths.append(p.resolve())
    return paths


def _built(paths: Sequence[Path], text: str, flags: Sequence[str], kdir: Path,
           what: str) -> tuple[str, Path]:
    """(cache key, path) of the shared library built from `text`: built at most once, and
    returned only once its sha256 matches its manifest (see `compile.verified_entry`). what:
    the library's contents in words, for the first-compile notice."""
    build_timeout()  # a bad $BURSTCU_BUILD_TIMEOUT is an error on every call, cached or not
    folder = cache_dir()

    def key_of() -> str:
        return _cache_key(paths, text, flags, kdir)

    def make(key: str) -> tuple[str, Path]:
        target = folder / f"{key}.so"
        made: list = []   # before the entry's lock: the PCH and the runtime have locks of their own

        def pch_and_runtime():
            pch = _precompiled_header(kdir)
            made.extend([pch, _runtime_object(kdir, flags, pch)])
            _remove_stale(keep=[made[1]] + ([pch.parent] if pch else []))

        def link():   # a runtime object deleted since (clear_cache) is made again, not an error
            runtime = made[1] if made[1].exists() else _runtime_object(kdir, flags, made[0])
            _gxx(text, [*_BASE_FLAGS, f"-I{kdir}", *flags], [runtime], target, made[0])

        verified_entry(folder, key, [target.name], link, before_lock=pch_and_runtime,
                       sources_unchanged=lambda: key_of() == key)
        return key, target

    built = built_from_sources(key_of, make)
    _FIRST_COMPILE.finished(what)
    return built


def build_module(
    sources: Sequence[str | Path],
    name_expressions: Sequence[str],
    options: tuple[str, ...] = (),
    randomize: bool = False,
    seed: int = 0,
) -> "EmuModule":
    """Build (or load from the cache) the emulated module of `sources` with the kernels `name_expressions`.

    sources: ``.cu`` files; a relative path is looked up in ``kernels/`` first, then the cwd.
    options: NVRTC-style options; ``-D``/``-U``/``-I``/``-O``/``-g`` are passed to g++, NVRTC-only ones
    (``--gpu-architecture``, ``-std``, ...) are ignored, anything else is a ValueError.
    randomize/seed: the module's default for launches (see `EmuFunction.__call__`): a launch
    that names no seed takes `seed` plus the number of this module's launches before it, so
    each explores another order and a run of launches repeats as a whole.
    """
    kdir = kernel_dir().resolve()
    paths = _source_paths(sources, kdir)
    flags = _translate_options(options)
    text = _generated_source(paths, name_expressions)
    with _LOADED_LOCK:
        key, target = _built(paths, text, flags, kdir, ", ".join(name_expressions))
        if key not in _LOADED:
            _LOADED[key] = EmuModule(target, list(name_expressions))
    mod = _LOADED[key]
    return EmuModule(mod.path, mod.names, randomize=randomize, seed=seed, _lib=mod._lib)


# C++17: burstcu_member_count<T>() is the number of members of the aggregate T, as the largest
# number of initializers T{...} accepts from values convertible to anything (a nested struct takes
# one). Compiles under g++ and NVRTC alike.
_MEMBER_COUNT_CXX = """
struct burstcu_any { template <class T> operator T() const; };
template <class T, class... A> constexpr auto burstcu_takes(int) -> decltype(T{A{}...}, true) { return true; }
template <class T, class... A> constexpr bool burstcu_takes(...) { return false; }
template <class T, class... A> constexpr unsigned long long burstcu_member_count() {
  if constexpr (sizeof...(A) > 256 || !burstcu_takes<T, A..., burstcu_any>(0)) return sizeof...(A);
  else return burstcu_member_count<T, A..., burstcu_any>();
}
"""
_TYPE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_:<>, ]*")
_MEMBER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def struct_layout(source: str | Path, type_name: str, members: Sequence[str]) -> dict:
    """How g++ lays out the C++ type `type_name` of kernels/`source` (a header or .cu file).

    members: member paths such as ``"q"`` or ``"blk.q_len"``. Returns {"size": sizeof,
    "align": alignof, "count": the number of members of the (aggregate) type, "members":
    {path: (offsetof, sizeof, kind)}}, kind as the emulator's argument check spells it ('p'
    pointer, 'i' signed, 'u' unsigned, 'f' float, 'b' bool, 's' struct). The count is the largest
    number of initializers the type accepts in aggregate initialization (each member can take one
    value of a type convertible to anything, so nested structs count once), which finds a member
    that `members` does not name. A member the type lacks fails the build: RuntimeError with
    g++'s message.
    """
    return struct_layouts(source, {type_name: members})[type_name]


def struct_layouts(source: str | Path, types: dict[str, Sequence[str]]) -> dict[str, dict]:
    """`struct_layout` of every {type name: member paths} of `types`, from one g++ build."""
    for type_name, members in types.items():
        if not _TYPE_RE.fullmatch(type_name):
            raise ValueError(f"invalid type name {type_name!r}")
        bad = [m for m in members if not _MEMBER_RE.fullmatch(m)]
        if bad:
            raise ValueError(f"invalid member paths {bad}")
    kdir = kernel_dir().resolve()
    paths = _source_paths([source], kdir)
    lines = ["// generated by burstcu/build/emulate.py (struct_layouts)", "#include <cstddef>",
             '#include "emu/cuda_emu.h"', f'#include "{paths[0]}"', _MEMBER_COUNT_CXX]
    for t, (type_name, members) in enumerate(types.items()):   # a function a type
        lines += [f"namespace {{ using burstcu_layout_{t} = {type_name}; }}",
                  f'extern "C" __attribute__((visibility("default"))) void burstcu_struct_layout_{t}('
                  "unsigned long long* out) {",
                  f"  out[0] = sizeof(burstcu_layout_{t});", f"  out[1] = alignof(burstcu_layout_{t});",
                  f"  out[2] = burstcu_member_count<burstcu_layout_{t}>();"]
        for i, m in enumerate(members):
            member = f"(static_cast<burstcu_layout_{t}*>(nullptr)->{m})"
            lines += [f"  out[{3 + 3 * i}] = offsetof(burstcu_layout_{t}, {m});",
                      f"  out[{4 + 3 * i}] = sizeof{member};",
                      f"  out[{5 + 3 * i}] = ::emu::kind_of<decltype{member}>();"]
        lines.append("}")
    text = "\n".join(lines) + "\n"
    _, target = _built(paths, text, [], kdir, f"the layout probe of {', '.join(types)}")
    lib = ctypes.CDLL(str(target))
    found = {}
    for t, (type_name, members) in enumerate(types.items()):
        out = (ctypes.c_ulonglong * (3 + 3 * len(members)))()
        getattr(lib, f"burstcu_struct_layout_{t}")(out)
        found[type_name] = {"size": out[0], "align": out[1], "count": out[2],
                            "members": {m: (out[3 + 3 * i], out[4 + 3 * i], chr(out[5 + 3 * i]))
                                        for i, m in enumerate(members)}}
    return found


class EmuModule:
    """A loaded emulated module: `get_function(name)` like CuPy's ``RawModule``."""

    def __init__(self, path: Path, names: list[str], randomize: bool = False, seed: int = 0, _lib=None):
        self.path = Path(path)
        self.names = names
        self.randomize = randomize
        self.seed = seed
        self.launches = 0   # of this module's functions so far (a launch's default seed)
        self._lib = _lib if _lib is not None else _load(self.path)

    def get_function(self, name: str) -> "EmuFunction":
        registered = self.kernel_names()
        if "".join(name.split()) not in registered:
            raise KeyError(f"{name!r} is not in this module (it has {registered})")
        return EmuFunction(self, name)

    def kernel_names(self) -> list[str]:
        n = self._lib.emu_kernel_names(None, 0)
        buf = ctypes.create_string_buffer(n)
        self._lib.emu_kernel_names(buf, n)
        return [s for s in buf.value.decode().split("\n") if s]

    def switch_count(self) -> int:
        """Fiber context switches performed by this module's emulator so far (for benchmarks)."""
        return int(self._lib.emu_switch_count())

    def global_adds(self) -> dict:
        """Adds into global memory by this module's kernels so far (tests): {"atomic_add": atomicAdd
        calls, "red_add_v2": red.global.add.v2.f32 instructions, "bulk_reduce": bulk tensor
        reductions}."""
        out = (ctypes.c_ulonglong * 3)()
        self._lib.emu_global_adds(out)
        return dict(zip(("atomic_add", "red_add_v2", "bulk_reduce"), (int(x) for x in out)))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [
        ctypes.c_char_p, *([ctypes.c_uint] * 6), ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
        ctypes.c_char_p, ctypes.c_size_t,
    ]
    lib.emu_kernel_names.restype = ctypes.c_size_t
    lib.emu_kernel_names.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.emu_switch_count.restype = ctypes.c_ulonglong
    lib.emu_switch_count.argtypes = []
    lib.emu_global_adds.restype = None
    lib.emu_global_adds.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    lib.emu_release.restype = None
    lib.emu_release.argtypes = []
    return lib


def _dims(d: Any, what: str) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {d!r}")
    return tuple(int(x) for x in t) + (1,) * (3 - len(t))  # type: ignore[return-value]


def _marshal(args: Sequence[Any]) -> tuple[list, list[int], bytes]:
    """Each argument as (a ctypes object holding its value, its size, its kind letter)."""
    holders, sizes, kinds = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            holders.append(ctypes.c_void_p(a.ctypes.data))
            sizes.append(ctypes.sizeof(ctypes.c_void_p))
            kinds.append("p")
        elif a is None:
            holders.append(ctypes.c_void_p(0))
            sizes.append(ctypes.sizeof(ctypes.c_void_p))
            kinds.append("p")
        elif isinstance(a, np.generic) and a.dtype.kind in _SCALAR_KIND:
            raw = a.tobytes()
            holders.append(ctypes.create_string_buffer(raw, len(raw)))
            sizes.append(len(raw))
            kinds.append(_SCALAR_KIND[a.dtype.kind])
        elif isinstance(a, (bool, int, float)):
            raise TypeError(
                f"argument {i} is a Python {type(a).__name__} ({a!r}); pass a numpy scalar of the kernel "
                f"parameter's exact type (np.int32, np.uint32, np.int64, np.float32, np.float64, np.bool_)"
            )
        else:
            raise TypeError(f"argument {i} of type {type(a).__name__} cannot be passed to an emulated kernel")
    return holders, sizes, "".join(kinds).encode()


class EmuFunction:
    """One registered kernel; called like CuPy's ``RawKernel``: ``fn(grid, block, args, shared_mem=0)``."""

    def __init__(self, module: EmuModule, name: str):
        self.module = module
        self.name = name

    def __call__(
        self,
        grid: Any,
        block: Any,
        args: Sequence[Any],
        shared_mem: int = 0,
        *,
        randomize: bool | None = None,
        seed: int | None = None,
        allow_exit_before_barrier: bool = False,
    ) -> None:
        """Run the kernel to completion on the CPU.

        randomize: resume threads released together (start, barrier, warp collective) and the
        blocks of the grid in a seeded random order, which exposes missing barriers; defaults to
        the module's setting. seed: the order's; defaults to the module's seed plus its launches
        so far (`build_module`). allow_exit_before_barrier: let exited threads drop out of later
        __syncthreads (sm_70+ behaviour) instead of reporting it as an error.
        Raises RuntimeError with the emulator's message (deadlock, divergent barrier, fault, ...).
        """
        g, b = _dims(grid, "grid"), _dims(block, "block")
        holders, sizes, kinds = _marshal(args)
        n = len(holders)
        ptrs = (ctypes.c_void_p * max(n, 1))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        c_sizes = (ctypes.c_size_t * max(n, 1))(*sizes)
        rnd = self.module.randomize if randomize is None else randomize
        flags = (1 if rnd else 0) | (2 if allow_exit_before_barrier else 0)
        err = ctypes.create_string_buffer(4096)
        with _LAUNCH_LOCK:
            sd = self.module.seed + self.module.launches if seed is None else seed
            self.module.launches += 1
            _keep_pool(self.module._lib)
            rc = self.module._lib.emu_launch(
                self.name.encode(), *g, *b, int(shared_mem), ptrs, c_sizes, kinds, n,
                int(sd) & (2**64 - 1), flags, err, len(err),
            )
        if rc != 0:
            raise RuntimeError(f"emulated kernel {self.name}: {err.value.decode(errors='replace')}")


def _keep_pool(lib: ctypes.CDLL) -> None:
    """`lib` launches now: it becomes the most recent of _POOL_HOLDERS, and the oldest past
    POOLS_KEPT give their fibers back (under _LAUNCH_LOCK)."""
    _POOL_HOLDERS[id(lib)] = lib
    _POOL_HOLDERS.move_to_end(id(lib))
    while len(_POOL_HOLDERS) > max(1, POOLS_KEPT):
        _, oldest = _POOL_HOLDERS.popitem(last=False)
        oldest.emu_release()


def clear_cache() -> None:
    """Delete every cached emulator build (the in-process modules stay loaded)."""
    shutil.rmtree(cache_dir(), ignore_errors=True)
