"""The one compile path of the CUDA kernels: NVRTC (through `cuda.bindings.nvrtc`) to a CUBIN.

Two users, one function (`nvrtc_compile`), the same options:

* the compile gate (`python -m burstcu.build check`) compiles every variant of each tile
  table for the arch it is named after (sm_80, sm_86, sm_90, sm_90a; a variant with a
  `KernelVariant.target` for that target) with ``-Xptxas=-v`` and reads the ptxas resource report
  (`parse_ptxas`); for sm_90a it also reads the SASS (`sass_summary`, NVIDIA's nvdisasm from the
  ``nvidia-cuda-nvdisasm`` wheel); this needs no GPU;
* at run time on a GPU, `get_function` compiles the variant for the device's own arch (not the
  tile table's name: an sm_120 device running the "sm_86" table gets an sm_120 CUBIN), or for the
  variant's `target` when it names one (sm_90a: compute capability 9.0 only), keeps the
  CUBIN and its lowered (mangled) kernel name in an on-disk cache shared by all ranks (a
  `filelock` per entry, so the first rank compiles and the others wait and load), loads it with
  ``cupy.RawModule(path=...)`` and memoizes the module per (source hash, options, arch, device).

Why not ``cupy.RawModule(code=..., name_expressions=...)``: CuPy's own cache key hashes the
source text and options but not the headers pulled in by ``-I``, so an edit of common.cuh would
load a stale kernel; CuPy would also use whichever NVRTC it finds, not the pinned one the gate
checked. Compiling here keeps gate and run time on the same compiler and flags, with a key that
includes every local header's contents (`source_digest`).

Cache folder (`cache_dir`): $BURSTCU_CACHE_DIR if set, else ``$TMPDIR/burstcu-<uid>`` (``/tmp``
when TMPDIR is unset), one folder per user. The default is node-local on purpose: the ranks of a
node share it through file locks, and file locks on an NFS home folder (the usual ~/.cache on
clusters) can hang; each node compiles once. Set $BURSTCU_CACHE_DIR to share one folder across
nodes (on a file system whose locks work) or to keep the CUBINs across reboots. The emulator's
builds live in its ``emu/`` subfolder. Delete it freely.

Trust (`trusted_dir`): code from this folder runs in the process (the emulator's ``.so`` through
ctypes and the runtime objects linked into them, CUBINs on the GPU, the precompiled header inside
g++), so whoever can write the folder can run code as you. The cache folder and every folder burstcu
uses below it (``emu/``, ``emu/pch-*``) must therefore be a real folder, not a symbolic link (links
are not followed, even to a good folder: point $BURSTCU_CACHE_DIR at the folder itself), owned by
the current user and not writable by group or others. burstcu creates them with mode 0700 and
refuses any other with a RuntimeError that says how to fix it. The folders above the cache folder
are not checked: keep it where no one else can rename it away (a folder of your own, or a sticky-bit
/tmp as by default).

Entries: each is a few files plus ``<key>.manifest``, a JSON object
``{"format": 1, "sha256": {file name: sha256 hex digest of its content}}``, written (temp file +
rename) after the files it vouches for; ``<key>.lock`` serializes its builders. An entry is used
only when its manifest lists exactly its files and every digest matches: a missing manifest (a
cache from before manifests), a truncated or foreign file is rebuilt with a warning, never loaded.
A key is a digest of the sources, and the build reads them later: they are hashed again once it
is done, and a build that saw them change is dropped (`SourcesChangedError`), never recorded under
the key of the text before; `built_from_sources` builds again under the new key. A cache that
cannot be written serves what it holds; an entry it lacks is a CacheNotWritableError.

* NVRTC: ``<key>.cubin`` and ``<key>.json`` (lowered names, arch, source, log);
* emulator (`burstcu.build.emulate`): ``emu/<key>.so``;
* its runtime object, linked into every module of one option set: ``emu/runtime-<digest>.o``;
* its precompiled header: ``emu/pch-<digest>/`` holding ``emu_pch.h`` and ``emu_pch.h.gch``.

Deadlines (`build_timeout`): $BURSTCU_BUILD_TIMEOUT seconds (default 600) bound every wait of a
build on its own: each compiler run, and each build-lock acquisition at twice that (its holder
may run the compiler twice; locks are never nested) (the g++ subprocesses; NVRTC
compiles in-process, on a worker thread the caller stops waiting for). Past it, BuildTimeoutError
names what was waited for; inside a burstcu call on several ranks, the rank fails and the whole
group aborts (`burstcu.group.Call`), instead of every rank hanging behind one stuck compiler.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from filelock import FileLock
from filelock import Timeout as FileLockTimeout

from .variants import CAREFUL_SUFFIX, SMEM_PER_BLOCK, kernel_dir

# Options every compile uses (the arch and include dirs are added per call). --use_fast_math
# makes exp2f a single ex2.approx (FA2 does the same); -default-device lets common.cuh helpers
# omit __device__.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--use_fast_math")

T = TypeVar("T")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
_ANY_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message carries the compiler log."""


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel (bytes, except registers)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem_bytes: int


@dataclass
class Compiled:
    """One NVRTC compile: CUBIN, log, name expression -> lowered name, per-kernel resources."""

    cubin: bytes
    log: str
    lowered: dict[str, str]
    seconds: float
    resources: dict[str, Resources] = field(default_factory=dict)  # keyed by lowered name


# ------------------------------------------------------------------------------------------------
# sources and keys

def cuda_include_dir() -> str:
    """The folder holding cuda_fp16.h / cuda_bf16.h (NVRTC has no built-in copies)."""
    from cuda import pathfinder  # deferred: only compiling needs cuda-python

    found = pathfinder.find_nvidia_header_directory("cudart")
    if not found:
        raise CompileError("cannot find the CUDA runtime headers: pip install 'nvidia-cuda-runtime==13.0.*'")
    return str(found)


CUDA_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")   # what kernels/ includes from the CUDA headers


@lru_cache(maxsize=1)
def cuda_headers_digest() -> str:
    """sha256 over the names and contents of CUDA_HEADERS and every header they include from
    `cuda_include_dir()` (another headers wheel compiles other code); "" where there are none or
    they cannot be read (compiling then says why)."""
    try:
        folder = Path(cuda_include_dir()).resolve()   # /usr/local/cuda/include is often a link
        h = hashlib.sha256()
        # what they include, "..." or <...>: beside the including file or in the folder
        reached = _reached([(folder / name).resolve() for name in CUDA_HEADERS], _ANY_INCLUDE_RE,
                           lambda path, name: [(path.parent / name).resolve(), (folder / name).resolve()])
        for path in reached:
            name = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    except (CompileError, ImportError, OSError):
        return ""
    return h.hexdigest()


def _reached(starts: list[Path], include_re: re.Pattern, candidates) -> list[Path]:
    """`starts` and every file their #include lines (`include_re`) reach, recursively, sorted:
    candidates(path, name) lists where an included name may be; files that do not exist are left
    out."""
    seen: set[Path] = set()
    todo = list(starts)
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name in include_re.findall(path.read_text(errors="replace")):
            todo += candidates(path, name)
    return sorted(seen)


def local_includes(source: str, kdir: Path | None = None) -> list[Path]:
    """`source` and every quoted #include it reaches inside `kdir`, recursively, sorted.

    Includes that do not exist in `kdir` (system headers, or emu/ headers referenced from
    branches NVRTC never takes but that do exist) are part of the result only if the file exists.
    """
    kdir = Path(kdir or kernel_dir())
    return _reached([kdir / source], _INCLUDE_RE, lambda path, name: [(path.parent / name).resolve()])


def source_digest(source: str, kdir: Path | None = None) -> str:
    """sha256 over the names and contents of `source` and every local header it includes."""
    kdir = Path(kdir or kernel_dir())
    h = hashlib.sha256()
    for path in local_includes(source, kdir):
        h.update(str(path.relative_to(kdir.resolve()) if path.is_relative_to(kdir.resolve()) else path).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def nvrtc_options(arch: str, kdir: Path | None = None, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The full NVRTC option list for `arch` ("sm_80", "sm_90", "sm_86", ...)."""
    kdir = Path(kdir or kernel_dir())
    return (*BASE_OPTIONS, f"--gpu-architecture={arch}", f"-I{kdir}", f"-I{cuda_include_dir()}", *extra)


# ------------------------------------------------------------------------------------------------
# NVRTC

# what installs NVRTC, its headers and nvdisasm (the cuda13 extra; cuda12 for a CUDA 12 driver)
CUDA_EXTRA_INSTALL = "pip install 'burstcu[cuda13]'"


def compiler_problem() -> str | None:
    """Why NVRTC cannot compile here, as one line that names the extra to install, or None.

    Asked by the compile gate before it starts its worker processes, whose tracebacks would
    bury the reason: cuda-python's ``cuda.bindings.nvrtc`` or ``cuda.pathfinder`` not importable,
    the NVRTC library not loadable, or the CUDA runtime headers not found.
    """
    try:
        from cuda import pathfinder  # noqa: F401 - only compiling needs cuda-python
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError as exc:
        return (f"cuda-python is not importable ({exc}); the kernel compiler comes with the CUDA "
                f"extra: {CUDA_EXTRA_INSTALL} (or 'burstcu[cuda12]' for a CUDA 12 driver)")
    try:
        nvrtc_version()
        cuda_include_dir()
    except Exception as exc:  # noqa: BLE001 - a missing library surfaces as several kinds
        return f"NVRTC cannot compile here ({exc}); {CUDA_EXTRA_INSTALL} installs it"
    return None


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that compiles here."""
    from cuda.bindings import nvrtc

    return tuple(_check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


def _check(result, what: str):
    """Unpack a cuda.bindings return tuple, raising on an NVRTC error."""
    from cuda.bindings import nvrtc

    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_compile(source: str, name_expressions: Sequence[str], arch: str,
                  extra_options: Sequence[str] = (), kdir: Path | None = None,
                  ptxas_verbose: bool = False) -> Compiled:
    """Compile kernels/`source` for `arch` to a CUBIN, instantiating `name_expressions`.

    With `ptxas_verbose` the ptxas report is parsed into `Compiled.resources`. Raises
    CompileError with the log on failure. Needs no GPU.
    """
    from cuda.bindings import nvrtc

    kdir = Path(kdir or kernel_dir())
    options = nvrtc_options(arch, kdir, (*extra_options, *(["-Xptxas=-v"] if ptxas_verbose else [])))
    start = time.perf_counter()
    # named by its full path: NVRTC looks for a quoted #include beside the program's name before
    # the -I folders, so a bare name would take a common.cuh from the working directory
    prog = _check(nvrtc.nvrtcCreateProgram((kdir / source).read_bytes(), str(kdir / source).encode(),
                                           0, [], []), "nvrtcCreateProgram")
    try:
        for name in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), f"nvrtcAddNameExpression({name})")
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _program_log(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed on {source} for {arch} "
                               f"({', '.join(name_expressions)}):\n{log}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {n: _check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), "nvrtcGetLoweredName").decode()
                   for n in name_expressions}
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    seconds = time.perf_counter() - start
    return Compiled(cubin, log, lowered, seconds, parse_ptxas(log) if ptxas_verbose else {})


def _program_log(prog) -> str:
    from cuda.bindings import nvrtc

    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return buf.rstrip(b"\0 ").decode(errors="replace")


_FUNC_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, Resources]:
    """The ptxas `-v` report as {lowered kernel name: Resources}.

    ptxas prints, per function: "Function properties for NAME", then "N bytes stack frame, N bytes
    spill stores, N bytes spill loads", then "Used N registers, ..., N bytes smem, ..." (the smem
    part only when the kernel has static shared memory).
    """
    out: dict[str, Resources] = {}
    current, frame = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME_RE.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _USED_RE.search(line)) and current:
            smem = _SMEM_RE.search(line)
            out[current] = Resources(registers=int(m.group(1)), spill_stores=frame[1],
                                     spill_loads=frame[2], stack_bytes=frame[0],
                                     static_smem_bytes=int(smem.group(1)) if smem else 0)
            current = None
    return out


# ------------------------------------------------------------------------------------------------
# SASS: what ptxas made of a kernel, read back from its CUBIN

# The disassembler is nvdisasm from the nvidia-cuda-nvdisasm wheel (the cuda13 extra). That wheel
# was never published for 13.0 (13.2 is the oldest there is); 13.2 reads the CUBINs NVRTC 13.0
# writes for every arch here, sm_90a included. `cuobjdump -sass` is no alternative: it runs
# nvdisasm itself.
NVDISASM_REQUIREMENT = "nvidia-cuda-nvdisasm==13.2.*"
# the compile targets whose gate records carry the SASS summary (sass_hgmma, sass_ldl, sass_stl)
SASS_ARCHS = ("sm_90a",)
# .nv.info attributes (the CUBIN's per-function records; cuobjdump -elf names them EIATTR_*)
EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE = 0x11, 0x12
EIFMT_SVAL = 0x04  # an attribute with a payload: u8 format, u8 attribute, u16 size, then size bytes


class DisassemblerMissing(RuntimeError):
    """nvdisasm cannot be found; the message says how to install it."""


class SassError(RuntimeError):
    """nvdisasm failed on a CUBIN, or the CUBIN is not an ELF file this reader understands."""


@dataclass(frozen=True)
class Sass:
    """One function of a CUBIN: counts of SASS instructions, and its local memory.

    `local_bytes` is the local memory (bytes per thread) the function reserves, as the CUBIN
    records it (`.nv.info`): the larger of its stack frame (EIATTR_FRAME_SIZE, what ptxas -v prints
    as "N bytes stack frame") and its stack with callees (EIATTR_MIN_STACK_SIZE, ptxas' "cumulative
    stack size"). It is 0 exactly when the function has no local memory: no spill slots, no array
    that stays in local memory (one indexed at run time), no call stack. `ldl`/`stl` count the
    instructions that read and write local memory (LDL, STL, any width).
    """

    instructions: int
    hgmma: int
    ldl: int
    stl: int
    local_bytes: int


@lru_cache(maxsize=None)
def find_nvdisasm() -> str | None:
    """The path of nvdisasm, or None: `cuda.pathfinder` (NVIDIA wheels first, then conda and
    CUDA_HOME / CUDA_PATH), else the wheel's own folder (nvidia/cu13/bin, or nvidia/cuda_nvdisasm/bin
    of the cu12 wheel), else PATH."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("nvdisasm")
        if found:
            return str(found)
    except Exception:  # a cuda-pathfinder without find_nvidia_binary_utility, or its search failed
        pass
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for root in getattr(nvidia, "__path__", ()):
            for sub in ("cu13", "cuda_nvdisasm"):
                candidate = Path(root) / sub / "bin" / "nvdisasm"
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return str(candidate)
    except ImportError:
        pass
    return shutil.which("nvdisasm")


def elf_local_bytes(cubin: bytes) -> dict[str, int]:
    """{function name (lowered): local bytes} from a CUBIN's ``.nv.info`` records (`Sass.local_bytes`).

    A function with no record has none (ptxas records every function's frame, 0 included).
    Raises SassError when `cubin` is not a 64-bit little-endian ELF file.
    """
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
            raise SassError("not a CUBIN (a 64-bit little-endian ELF file)")
        (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

        def body(sec) -> bytes:
            return cubin[sec[4]:sec[4] + sec[5]]

        def cstr(blob: bytes, offset: int) -> str:
            return blob[offset:blob.index(b"\0", offset)].decode(errors="replace")

        shstr = body(sections[shstrndx])
        symtab = next((sec for sec in sections if sec[1] == 2), None)  # SHT_SYMTAB
        if symtab is None:
            return {}
        strtab, syms = body(sections[symtab[6]]), body(symtab)
        symbols = [cstr(strtab, struct.unpack_from("<I", syms, off)[0]) for off in range(0, len(syms) - 23, 24)]
        out: dict[str, int] = {}
        for sec in sections:
            if not cstr(shstr, sec[0]).startswith(".nv.info"):
                continue
            blob, i = body(sec), 0
            while i + 4 <= len(blob):
                fmt, attr, size = blob[i], blob[i + 1], struct.unpack_from("<H", blob, i + 2)[0]
                i += 4
                if fmt != EIFMT_SVAL:  # no value, or one in the u16 itself
                    continue
                if attr in (EIATTR_FRAME_SIZE, EIATTR_MIN_STACK_SIZE) and size == 8:
                    sym, value = struct.unpack_from("<II", blob, i)
                    if 0 < sym < len(symbols):
                        out[symbols[sym]] = max(out.get(symbols[sym], 0), value)
                i += size
        return out
    except (struct.error, IndexError, ValueError) as exc:
        raise SassError(f"cannot read the CUBIN's ELF records: {exc}") from None


_SECTION_RE = re.compile(r'^\s*\.section\s+"?([^",\s]+)')
# "/*0130*/   @!P0 HGMMA.64x64x16.F32 R24, ..." -> HGMMA (after an optional predicate)
_INSTR_RE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+(?:\{\s*)?(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)\b")


def parse_sass(text: str) -> dict[str, dict[str, int]]:
    """nvdisasm's listing as {function name: {opcode: count}}: the instructions of each
    ``.text.<function>`` section, by opcode without modifiers (``LDL.LU.64`` counts as LDL)."""
    out: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in text.splitlines():
        if m := _SECTION_RE.match(line):
            name = m.group(1)
            current = out.setdefault(name[len(".text."):], {}) if name.startswith(".text.") else None
        elif current is not None and (m := _INSTR_RE.match(line)):
            current[m.group(1)] = current.get(m.group(1), 0) + 1
    return out


def sass_summary(cubin: bytes) -> dict[str, Sass]:
    """{function name (lowered): Sass} for every function of `cubin` (kernels and device
    functions that were not inlined), from nvdisasm's listing and the CUBIN's records.

    Raises DisassemblerMissing when nvdisasm cannot be found, SassError when it fails, and
    BuildTimeoutError past `build_timeout()`. Needs no GPU.
    """
    tool = find_nvdisasm()
    if tool is None:
        raise DisassemblerMissing(
            f"nvdisasm not found: the SASS check (HGMMA present, no local memory) of sm_90a kernels "
            f"needs it; install it with pip install '{NVDISASM_REQUIREMENT}' (part of the cuda13 extra)")
    local = elf_local_bytes(cubin)
    with tempfile.TemporaryDirectory(prefix="burstcu-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            proc = run_bounded([tool, "--print-code", "--no-dataflow", str(path)], "disassembler")
        except OSError as exc:
            raise SassError(f"cannot run {tool}: {exc}") from None
    if proc.returncode != 0:
        raise SassError(f"{tool} failed (exit {proc.returncode}) on a CUBIN: {proc.stderr.strip()[-2000:]}")
    return {name: Sass(instructions=sum(ops.values()), hgmma=ops.get("HGMMA", 0), ldl=ops.get("LDL", 0),
                       stl=ops.get("STL", 0), local_bytes=local.get(name, 0))
            for name, ops in parse_sass(proc.stdout).items()}


# ------------------------------------------------------------------------------------------------
# the trusted cache: folders, manifests, deadlines (the module docstring has the rules)

DEFAULT_BUILD_TIMEOUT_S = 600.0
MAX_BUILD_WAIT_S = 1e6          # the longest a build waits (11 days): poll() takes at most 2**31 ms
# a lock wait outlasts its holder's longest build: up to two compiler runs (the emulator's: with
# the precompiled header, then without it), each within build_timeout()
LOCK_WAIT_BUILDS = 2
MANIFEST_FORMAT = 1
_WHY_TRUST = ("burstcu runs code it finds there, so anyone who can change the folder could run "
              "code in this process")


# builds in a row that may find their sources changed under them before `built_from_sources` gives up
SOURCE_CHANGE_TRIES = 3


class SourcesChangedError(RuntimeError):
    """The kernel sources changed while a build compiled them: what it made is not cached, since
    its key was computed from the sources as they were before (the build may have read either)."""


class CacheNotWritableError(RuntimeError):
    """A kernel the cache does not hold yet, in a cache folder this process cannot write."""


class BuildTimeoutError(RuntimeError):
    """A build waited longer than $BURSTCU_BUILD_TIMEOUT for a build lock or a compiler."""

    @classmethod
    def waited(cls, what: str, timeout: float, hint: str) -> "BuildTimeoutError":
        """The error for a wait of `timeout` seconds for `what`; `hint` says what may be behind it."""
        return cls(f"waited {timeout:g} s for {what}: {hint}. If builds are only slow here, "
                   f"raise the limit with BURSTCU_BUILD_TIMEOUT=<seconds>")


def run_bounded(cmd: Sequence[str], what: str = "compiler") -> subprocess.CompletedProcess:
    """Run a tool (g++, nvdisasm) to its end or to `build_timeout()`, capturing its output as text.

    It runs in a process group of its own, killed whole past the deadline or on an interrupt:
    killing g++ alone would leave its cc1plus running. Raises BuildTimeoutError naming the command.
    """
    timeout = build_timeout()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise BuildTimeoutError.waited(f"the {what} command `{' '.join(cmd)}`", timeout,
                                           "it did not finish and was killed") from None
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def build_timeout() -> float:
    """Seconds one wait of a build may last: $BURSTCU_BUILD_TIMEOUT, default 600.

    Raises ValueError naming the variable when it is not a positive, finite number; one past
    MAX_BUILD_WAIT_S waits that long (poll(), under subprocess, takes no longer).
    """
    raw = os.environ.get("BURSTCU_BUILD_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"BURSTCU_BUILD_TIMEOUT={raw!r}: it must be a positive number of seconds "
                         f"(the longest a kernel build may wait for a lock or a compiler; "
                         f"unset, {DEFAULT_BUILD_TIMEOUT_S:g})")
    return min(value, MAX_BUILD_WAIT_S)


@contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Hold the file lock `path` (the builders of one cache entry), waiting at most `build_timeout()`.

    Raises BuildTimeoutError when another process holds it longer.
    """
    timeout = LOCK_WAIT_BUILDS * build_timeout()
    lock = FileLock(str(path), timeout=timeout)
    try:
        lock.acquire()
    except FileLockTimeout:
        raise BuildTimeoutError.waited(
            f"the build lock {path}", timeout, "another process holds it (a rank building the same "
            f"kernel, or a stuck one: `fuser {path}` names it; if none does, delete the file)") from None
    try:
        yield
    finally:
        lock.release()


def with_deadline(fn: Callable[[], T], what: str) -> T:
    """fn(), run on a worker thread and waited for at most `build_timeout()` seconds.

    For work that cannot be killed (NVRTC compiles inside this process). On expiry the thread is
    abandoned (a daemon: it does not keep the process alive) and BuildTimeoutError is raised; the
    caller ends the process (on several ranks, `burstcu.group.Call` aborts the group).
    """
    timeout = build_timeout()
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome["error"] = exc

    worker = threading.Thread(target=work, name=f"burstcu build: {what}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise BuildTimeoutError.waited(what, timeout, "it did not finish (its thread is abandoned)")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def trusted_dir(path: str | os.PathLike) -> Path:
    """`path` as a cache folder only this user can change; created with mode 0700 when missing.

    A real folder (a symbolic link is refused, not followed), owned by this user, not writable by
    group or others; its parents are created when missing but not checked. Raises RuntimeError
    saying what is wrong, why it matters and how to fix it.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)   # FileExistsError: a file on the way
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    except OSError as exc:
        raise RuntimeError(f"the kernel cache folder {path} cannot be made ({exc.__class__.__name__}: "
                           f"{exc}). Fix: set BURSTCU_CACHE_DIR to a folder of your own") from exc
    st = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)}), which burstcu does not follow"
        fix = "point BURSTCU_CACHE_DIR at a real folder of your own, or remove the link"
    elif not stat.S_ISDIR(st.st_mode):
        problem, fix = "is not a folder", "remove it, or set BURSTCU_CACHE_DIR to another folder"
    elif st.st_uid != uid:
        problem = f"belongs to uid {st.st_uid}, not to you (uid {uid})"
        fix = f"set BURSTCU_CACHE_DIR to a folder of your own (or, if it is yours, `chown {uid} {path}`)"
    elif st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit)
        problem = f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
        fix = f"`chmod go-w {path}`, or set BURSTCU_CACHE_DIR to a private folder"
    else:
        return path
    raise RuntimeError(f"the kernel cache folder {path} {problem}; {_WHY_TRUST}. Fix: {fix}")


def open_regular(path: Path):
    """`path` opened for reading (a binary file object), or OSError when it is not a regular file:
    a FIFO in a cache entry's place would block a plain open until something wrote to it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(fd, "rb")


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a regular file's content (`open_regular`)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, key: str, names: Sequence[str]) -> None:
    """Record the sha256 of each file `names` of `folder` in folder/<key>.manifest (atomically)."""
    digests = {name: file_sha256(folder / name) for name in names}
    atomic_write(folder / f"{key}.manifest",
                 json.dumps({"format": MANIFEST_FORMAT, "sha256": digests}, sort_keys=True).encode())


def manifest_problem(folder: Path, key: str, names: Sequence[str]) -> str | None:
    """Why folder/<key>.manifest does not vouch for the files `names`, or None when it does."""
    manifest = folder / f"{key}.manifest"
    entry = ", ".join(str(folder / name) for name in names)
    try:
        with open_regular(manifest) as f:
            recorded = json.loads(f.read())
    except FileNotFoundError:
        return f"{entry}: no manifest vouches for it ({manifest.name} is missing)"
    except (OSError, ValueError) as exc:
        return f"{entry}: its manifest {manifest.name} cannot be read ({exc})"
    fits = isinstance(recorded, dict) and recorded.get("format") == MANIFEST_FORMAT
    digests = recorded.get("sha256") if fits else None
    if not isinstance(digests, dict) or sorted(digests) != sorted(names):
        return f"{entry}: its manifest {manifest.name} does not list exactly these files"
    for name in names:
        try:
            if file_sha256(folder / name) != digests[name]:
                return f"{folder / name} does not match its sha256 in {manifest.name}"
        except OSError as exc:
            return f"{folder / name} cannot be read ({exc.strerror or exc})"
    return None


def verified_entry(folder: Path, key: str, names: Sequence[str], build: Callable[[], None],
                   before_lock: Callable[[], None] | None = None,
                   sources_unchanged: Callable[[], bool] | None = None) -> bool:
    """Make the cache entry `key` (the files `names` of the trusted `folder`) present and verified;
    whether this call built it.

    Returns at once when its manifest vouches for every file. Else (CacheNotWritableError when
    `folder` is read-only) runs `before_lock` (work with a lock of its own, such as the
    precompiled header: locks are never nested), then, holding folder/<key>.lock, checks again
    (another process may have built it meanwhile), calls `build` (which writes the files, each
    atomically) and records the manifest; an entry that was there but failed the check is
    rebuilt, never used, with a warning naming the file. `sources_unchanged`, asked once `build`
    is done: whether the sources still have the digest `key` was made from; when they do not,
    the files are removed, no manifest is written, and SourcesChangedError is raised (retry
    with `built_from_sources`).
    """
    if manifest_problem(folder, key, names) is None:
        return False
    if not os.access(folder, os.W_OK):
        raise CacheNotWritableError(
            f"the kernel cache folder {folder} cannot be written (read-only), and it does not hold "
            f"{', '.join(names)} yet. Fix: set BURSTCU_CACHE_DIR to a folder you can write (a copy "
            f"of this one keeps what it holds), or fill this one where it is writable (a run that "
            f"uses the kernel; for a GPU's kernels, `python -m burstcu.build warm --device sm_XX`)")
    if before_lock is not None:   # what `build` needs that has a lock of its own (no nesting)
        before_lock()
    with build_lock(folder / f"{key}.lock"):
        problem = manifest_problem(folder, key, names)
        if problem is None:
            return False
        stale = any((folder / name).exists() for name in (*names, f"{key}.manifest"))
        build()
        if sources_unchanged is not None and not sources_unchanged():
            for name in names:
                (folder / name).unlink(missing_ok=True)
            raise SourcesChangedError(
                f"the kernel sources changed while {', '.join(names)} was built from them; "
                f"the result was dropped, not cached under the key of the sources as they were")
        write_manifest(folder, key, names)
    if stale:
        warnings.warn(f"burstcu kernel cache: {problem}; rebuilt the entry", stacklevel=3)
    return True


def built_from_sources(key_of: Callable[[], str], make: Callable[[str], T]) -> T:
    """make(key_of()): the cache entry of the sources as they are, where `make` passes
    ``lambda: key_of() == key`` to `verified_entry` as `sources_unchanged`. A source saved while
    it was compiled (SourcesChangedError) costs a new key and a new build, up to
    SOURCE_CHANGE_TRIES builds in all; then the error names what to do."""
    for attempt in range(SOURCE_CHANGE_TRIES):
        try:
            return make(key_of())
        except SourcesChangedError as exc:
            if attempt == SOURCE_CHANGE_TRIES - 1:
                raise SourcesChangedError(f"{exc}, in each of {SOURCE_CHANGE_TRIES} builds in a row. "
                                          f"Run again once the kernel sources are saved") from None
    raise AssertionError("unreachable")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `path` so that readers see the old file or the whole new one (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------------
# on-disk cache of CUBINs (shared by ranks) and run-time loading

def cache_dir() -> Path:
    """The kernel cache folder, trusted (`trusted_dir`): $BURSTCU_CACHE_DIR, else
    ``$TMPDIR/burstcu-<uid>``, node-local and per user (see the module docstring for why not
    ~/.cache). Raises RuntimeError when the folder fails the trust rule."""
    override = os.environ.get("BURSTCU_CACHE_DIR")
    if override:
        return trusted_dir(override)
    return trusted_dir(Path(os.environ.get("TMPDIR") or "/tmp") / f"burstcu-{os.getuid()}")


def cache_key(source: str, name_expressions: Sequence[str], arch: str,
              extra_options: Sequence[str] = (), kdir: Path | None = None) -> str:
    """Everything that specializes a CUBIN: sources + headers, options, arch, instantiations,
    the NVRTC version and the CUDA headers the sources include (`cuda_headers_digest`)."""
    kdir = Path(kdir or kernel_dir())
    parts = {
        "source": source, "digest": source_digest(source, kdir), "arch": arch,
        "options": list((*BASE_OPTIONS, *extra_options)), "names": list(name_expressions),
        "nvrtc": list(nvrtc_version()), "cuda_headers": cuda_headers_digest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cached_cubin(source: str, name_expressions: Sequence[str], arch: str,
                 extra_options: Sequence[str] = (), kdir: Path | None = None) -> tuple[Path, dict[str, str]]:
    """(path of the CUBIN, {name expression: lowered name}), compiling at most once per key
    (`cubin_entry`)."""
    cubin_path, meta_path, _ = cubin_entry(source, name_expressions, arch, extra_options, kdir)
    return cubin_path, json.loads(meta_path.read_text())["lowered"]


def cubin_entry(source: str, name_expressions: Sequence[str], arch: str,
                extra_options: Sequence[str] = (), kdir: Path | None = None) -> tuple[Path, Path, bool]:
    """(path of the CUBIN, path of its JSON, whether this call compiled them): the cache entry of
    the key, compiled at most once.

    Ranks sharing the cache folder serialize on the entry's file lock: the first compiles (within
    `build_timeout()`) and writes the entry, the others find it verified when they get the lock.
    """
    build_timeout()  # a bad $BURSTCU_BUILD_TIMEOUT is an error on every call, cached or not
    root = cache_dir()

    def key_of() -> str:
        return cache_key(source, name_expressions, arch, extra_options, kdir)

    def make(key: str) -> tuple[Path, Path, bool]:
        cubin_path, meta_path = root / f"{key}.cubin", root / f"{key}.json"

        def build() -> None:
            compiled = with_deadline(
                lambda: nvrtc_compile(source, name_expressions, arch, extra_options, kdir),
                f"NVRTC to compile {source} ({', '.join(name_expressions)}) for {arch}")
            atomic_write(cubin_path, compiled.cubin)
            atomic_write(meta_path, json.dumps({"lowered": compiled.lowered, "arch": arch,
                                                "source": source, "log": compiled.log}).encode())

        built = verified_entry(root, key, [cubin_path.name, meta_path.name], build,
                               sources_unchanged=lambda: key_of() == key)
        return cubin_path, meta_path, built

    return built_from_sources(key_of, make)


# cudaDeviceAttr values (CUDA runtime, driver_types.h)
ATTR_CC_MAJOR, ATTR_CC_MINOR, ATTR_SMEM_PER_BLOCK_OPTIN = 75, 76, 97
ATTR_SM_COUNT = 16  # cudaDevAttrMultiProcessorCount


def device_attribute(attr: int, device_id: int | None = None) -> int:
    """cudaDeviceGetAttribute(`attr`) of CUDA device `device_id` (CuPy's current one by default).

    Read through the runtime without making the device current: `cupy.cuda.Device(i)`'s
    properties switch to device i and back, which creates a CUDA context there (a failure on
    exclusive-process GPUs owned by another rank).
    """
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(attr, runtime.getDevice() if device_id is None else device_id))


def compute_capability(device_id: int | None = None) -> int:
    """major * 10 + minor of a CUDA device (the current one by default), e.g. 80, 90, 120."""
    return 10 * device_attribute(ATTR_CC_MAJOR, device_id) + device_attribute(ATTR_CC_MINOR, device_id)


def device_arch(device_id: int | None = None) -> str:
    """"sm_XY" of a CUDA device (CuPy's current one by default), read without switching to it."""
    return f"sm_{compute_capability(device_id)}"


_MODULES: dict[tuple, tuple] = {}   # (digest, options, arch, device, name) -> (RawModule, lowered)
_FUNCTIONS: dict[tuple, object] = {}  # (source, name, options, device, target) -> RawKernel, per process


def target_problem(target: str, cc: int) -> str | None:
    """Why a CUBIN for `target` cannot run on a device of compute capability `cc`, or None.

    An arch-specific target ("sm_90a": wgmma, setmaxnreg; any "sm_XYa") runs only on exactly
    that compute capability, not on a later one; a plain "sm_XY" runs on XY and newer.
    """
    m = re.fullmatch(r"sm_(\d+)([af]?)", target)
    if m is None:
        return f"unknown compile target {target!r} (expected e.g. 'sm_90a')"
    need = int(m.group(1))
    if m.group(2) == "a" and cc != need:
        return (f"{target} kernels run only on compute capability {need // 10}.{need % 10} "
                f"(this device is {cc // 10}.{cc % 10}): an arch-specific CUBIN does not load on any "
                f"other GPU; use a variant without this target here")
    if cc < need:
        return f"{target} kernels need compute capability {need // 10}.{need % 10} or newer (this device is {cc // 10}.{cc % 10})"
    return None


def get_function(source: str, name_expression: str, smem_bytes: int = 0,
                 extra_options: Sequence[str] = (), device_id: int | None = None, target: str = ""):
    """A `cupy.RawKernel` for one instantiation on a CuPy device (the current one by default).

    Compiled lazily for the device's own arch, or for `target` when it is not empty (a variant's
    `KernelVariant.target`, e.g. "sm_90a"; RuntimeError if the device cannot run it, see
    `target_problem`), through the disk cache, memoized per (source digest, options, arch,
    device). `smem_bytes` > 48 KB raises the kernel's dynamic-smem limit, which launches above
    48 KB require. Later calls in the process are one dict lookup (sources are not re-hashed per
    launch).
    """
    import cupy

    device_id = cupy.cuda.Device().id if device_id is None else device_id
    fast_key = (source, name_expression, tuple(extra_options), device_id, target)
    fn = _FUNCTIONS.get(fast_key)
    if fn is not None:
        return fn
    if target:
        problem = target_problem(target, compute_capability(device_id))
        if problem:
            raise RuntimeError(f"cannot run {name_expression} on device {device_id}: {problem}")
        arch = target
    else:
        arch = device_arch(device_id)
    key = (source_digest(source), tuple(extra_options), arch, device_id, name_expression)
    if key not in _MODULES:
        path, lowered = cached_cubin(source, [name_expression], arch, extra_options)
        with cupy.cuda.Device(device_id):
            _MODULES[key] = (cupy.RawModule(path=str(path)), lowered)
    module, lowered = _MODULES[key]
    with cupy.cuda.Device(device_id):
        fn = module.get_function(lowered[name_expression])
        if smem_bytes > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem_bytes
    _FUNCTIONS[fast_key] = fn
    return fn


# ------------------------------------------------------------------------------------------------
# the compile gate

# Per-arch limits the gate checks and computes occupancy from (CUDA programming guide, "Technical
# Specifications per Compute Capability").
ARCH_LIMITS = {
    "sm_80": {"regs_per_sm": 65536, "smem_per_sm": 164 * 1024, "smem_per_block": SMEM_PER_BLOCK["sm_80"],
              "threads_per_sm": 2048, "blocks_per_sm": 32, "gpu": "A100"},
    "sm_90": {"regs_per_sm": 65536, "smem_per_sm": 228 * 1024, "smem_per_block": SMEM_PER_BLOCK["sm_90"],
              "threads_per_sm": 2048, "blocks_per_sm": 32, "gpu": "H100"},
    # the sm_90 table plus the Hopper families, for the same GPUs (cc 9.0 only)
    "sm_90a": {"regs_per_sm": 65536, "smem_per_sm": 228 * 1024, "smem_per_block": SMEM_PER_BLOCK["sm_90"],
               "threads_per_sm": 2048, "blocks_per_sm": 32, "gpu": "H100"},
    # The "sm_86" table serves cc 8.6/8.7/8.9/12.x; the limits are sm_86's (cc 8.9 allows 24
    # blocks an SM, 12.0 32: a block-count bound never binds for these kernels).
    "sm_86": {"regs_per_sm": 65536, "smem_per_sm": 100 * 1024, "smem_per_block": SMEM_PER_BLOCK["sm_86"],
              "threads_per_sm": 1536, "blocks_per_sm": 16, "gpu": "RTX 3090/4090, L40S"},
}
MAX_REGISTERS = 255


def occupancy(record: dict) -> dict:
    """Blocks per SM each resource allows a gate record (registers, threads, smem_bytes) on its arch
    (`ARCH_LIMITS`: registers allocated per warp in units of 256, 1 KB of shared memory reserved a
    block): {blocks_per_sm, limited_by (the binding resource), warps_per_sm, occupancy (warps over
    the SM's most), by_resource}. COMPUTED from the ptxas report by the CUDA occupancy rules, not
    measured."""
    lim, warps = ARCH_LIMITS[record["arch"]], -(-record["threads"] // 32)
    regs_per_warp = -(-record["registers"] * 32 // 256) * 256
    by = {"regs": (lim["regs_per_sm"] // regs_per_warp) // warps if regs_per_warp else lim["blocks_per_sm"],
          "smem": lim["smem_per_sm"] // (record["smem_bytes"] + 1024),
          "threads": lim["threads_per_sm"] // record["threads"], "blocks": lim["blocks_per_sm"]}
    blocks = min(by.values())
    return {"blocks_per_sm": blocks, "limited_by": min(by, key=by.get), "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / (lim["threads_per_sm"] // 32), "by_resource": by}


# families that must run on the tensor cores of sm_90a (wgmma) with no local memory: the gate
# checks their SASS (`gate_failure`)
HOPPER_FAMILY_MARK = "sm90"


def gate_variant(variant, arch: str) -> dict:
    """Compile one KernelVariant of the tile table `arch` with the ptxas report; a JSON-ready record.

    The variant compiles for its `target` when it names one, else for `arch`. Keys: name,
    family, arch (the table), target (the arch compiled for), dtype, headdim, threads, registers,
    spill_stores, spill_loads, stack_bytes, static_smem_bytes, dynamic_smem_bytes, smem_bytes
    (static + dynamic), local_bytes (`Sass.local_bytes`, from the CUBIN), compile_seconds, the
    keys of `occupancy` (computed, not measured), error (None, or the reason the variant fails the
    gate). A record compiled for an arch of
    `SASS_ARCHS` (sm_90a) adds sass_hgmma, sass_ldl, sass_stl (instruction counts of the kernel's
    SASS, `sass_summary`), or None in each and sass_error saying why the SASS could not be read
    (no nvdisasm: the record fails).
    """
    target = getattr(variant, "target", "") or arch
    record = {"name": variant.name, "family": variant.family, "arch": arch, "target": target,
              "dtype": variant.dtype, "headdim": variant.headdim, "threads": variant.launch.threads,
              "dynamic_smem_bytes": variant.launch.smem_bytes, "error": None}
    try:
        compiled = nvrtc_compile(variant.source, [variant.name], target, ptxas_verbose=True)
    except (CompileError, OSError) as exc:
        record["error"] = str(exc)
        return record
    lowered = compiled.lowered[variant.name]
    res = compiled.resources.get(lowered)
    if res is None:
        record["error"] = f"no ptxas report for {lowered}"
        return record
    record.update(registers=res.registers, spill_stores=res.spill_stores, spill_loads=res.spill_loads,
                  stack_bytes=res.stack_bytes, static_smem_bytes=res.static_smem_bytes,
                  smem_bytes=res.static_smem_bytes + variant.launch.smem_bytes,
                  compile_seconds=round(compiled.seconds, 3),
                  ptxas_warnings=ptxas_concerns(compiled.log))
    try:
        record["local_bytes"] = elf_local_bytes(compiled.cubin).get(lowered, 0)
    except SassError as exc:
        record["error"] = str(exc)
        return record
    if target in SASS_ARCHS:
        record.update(sass_hgmma=None, sass_ldl=None, sass_stl=None)
        try:
            sass = sass_summary(compiled.cubin).get(lowered)
        except (DisassemblerMissing, SassError, BuildTimeoutError) as exc:
            record["sass_error"] = str(exc)
        else:
            if sass is None:
                record["sass_error"] = f"nvdisasm listed no code for {lowered}"
            else:
                record.update(sass_hgmma=sass.hgmma, sass_ldl=sass.ldl, sass_stl=sass.stl)
    record.update(occupancy(record))
    record["error"] = gate_failure(record)
    return record


def ptxas_concerns(log: str) -> list[str]:
    """The lines of a ptxas report that warn, or that note a performance loss: ptxas reports a
    serialized wgmma as info ("(C7512) Potential Performance Loss: wgmma.mma_async instructions
    are serialized due to ..."), not as a warning."""
    return [line.strip() for line in log.splitlines()
            if "warning" in line.lower() or "performance loss" in line.lower()]


def setmaxnreg_registers(threads: int) -> int:
    """The registers each of a block's `threads` threads must start with for the Hopper kernels'
    setmaxnreg split: setmaxnreg moves registers between warpgroups inside the block's pool, and
    the kernels' producer/consumer counts add up to the whole register file only if ptxas gave
    every thread the most a one-block launch allows (168 for 384 threads); with fewer, a
    consumer's setmaxnreg.inc waits forever for registers that are not there. The compile gate
    checks it of NVRTC 13.0's builds, KernelOps of the build it loads."""
    return ARCH_LIMITS["sm_90a"]["regs_per_sm"] // threads // 8 * 8


def gate_failure(record: dict) -> str | None:
    """Why a compiled record fails the gate, or None: its SASS could not be read (sm_90a without
    nvdisasm), spills, > 255 registers, smem over the arch; for a Hopper family (name containing
    "sm90") compiled for sm_90a, no HGMMA in its SASS (wgmma was not emitted, or ptxas serialized
    it away) or any local memory (local_bytes, LDL/STL)."""
    limits = ARCH_LIMITS.get(record["arch"])
    careful = record["family"].endswith(CAREFUL_SUFFIX)
    if record.get("sass_error"):
        return f"SASS check for {record.get('target') or record['arch']}: {record['sass_error']}"
    # careful variants run only where Inf/NaN meets masked pairs (variants.careful_variant):
    # their spills are in the record, not a failure
    if (record["spill_stores"] or record["spill_loads"]) and not careful:
        return f"spills {record['spill_stores']} B stored / {record['spill_loads']} B loaded"
    if record["registers"] > MAX_REGISTERS:
        return f"{record['registers']} registers > {MAX_REGISTERS}"
    if limits and record["smem_bytes"] > limits["smem_per_block"]:
        return f"{record['smem_bytes']} B smem > {limits['smem_per_block']} B per block on {record['arch']}"
    if HOPPER_FAMILY_MARK in record["family"] and (record.get("target") or record["arch"]) == "sm_90a":
        # ptxas warns when it serializes wgmma (e.g. "wgmma.mma_async instructions are
        # serialized due to ...") or ignores setmaxnreg (C7508): HGMMA is still in the SASS, but
        # the kernel has lost what it is for
        warned = [w for w in record.get("ptxas_warnings") or () if "wgmma" in w or "setmaxnreg" in w
                  or "C7508" in w]
        if warned:
            return f"ptxas: {warned[0]}"
        full = setmaxnreg_registers(record["threads"])
        if record["registers"] != full:
            return (f"{record['registers']} registers at launch, not {full}: the setmaxnreg "
                    f"split of {record['threads']} threads assumes the whole register file")
        if not record.get("sass_hgmma"):
            return ("no HGMMA instruction in the SASS: the kernel does not run on the wgmma tensor "
                    "cores (was it compiled without the wgmma path?)")
        local = record.get("local_bytes") or 0
        accesses = (record.get("sass_ldl") or 0) + (record.get("sass_stl") or 0)
        if (local or accesses) and not careful:
            return (f"local memory: {local} B a thread, {record.get('sass_ldl') or 0} LDL / "
                    f"{record.get('sass_stl') or 0} STL in the SASS (spills, a run-time indexed "
                    f"array, or an accumulator ptxas could not keep in registers across a wgmma)")
    return None
