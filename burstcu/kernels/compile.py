"""The one compile path of the CUDA kernels: NVRTC (through `cuda.bindings.nvrtc`) to a CUBIN.

Two users, one function (`nvrtc_compile`), the same options:

* the compile gate (`python -m burstcu.kernels check`) compiles every variant of each tile
  table for the arch it is named after (sm_80, sm_86, sm_90) with ``-Xptxas=-v`` and reads the
  ptxas resource report (`parse_ptxas`); this needs no GPU;
* at run time on a GPU, `get_function` compiles the variant for the device's own arch (not the
  tile table's name: an sm_120 device running the "sm_86" table gets an sm_120 CUBIN), keeps the
  CUBIN and its lowered (mangled) kernel name in an on-disk cache shared by all ranks (a
  `filelock` per entry, so the first rank compiles and the others wait and load), loads it with
  ``cupy.RawModule(path=...)`` and memoizes the module per (source hash, options, arch, device).

Why not ``cupy.RawModule(code=..., name_expressions=...)``: CuPy's own cache key hashes the
source text and options but not the headers pulled in by ``-I``, so an edit of common.cuh would
load a stale kernel; CuPy would also use whichever NVRTC it finds, not the pinned one the gate
checked. Compiling here keeps gate and run time on the same compiler and flags, with a key that
includes every local header's contents (`source_digest`).

Cache folder (`cache_dir`): $BURSTCU_CACHE_DIR if set, else ``$TMPDIR/burstcu-<uid>`` (``/tmp``
when TMPDIR is unset), one folder per user created with mode 0700. The default is node-local on
purpose: the ranks of a node share it through file locks, and file locks on an NFS home folder
(the usual ~/.cache on clusters) can hang; each node compiles once. Set $BURSTCU_CACHE_DIR to
share one folder across nodes (on a file system whose locks work) or to keep the CUBINs across
reboots. One entry = ``<key>.cubin`` + ``<key>.json`` + ``<key>.lock``; the emulator's builds
live in its ``emu/`` subfolder. Delete it freely.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .variants import CAREFUL_SUFFIX, kernel_dir

# Options every compile uses (the arch and include dirs are added per call). --use_fast_math
# makes exp2f a single ex2.approx (FA2 does the same); -default-device lets common.cuh helpers
# omit __device__.
BASE_OPTIONS = ("-std=c++17", "-default-device", "--use_fast_math")

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


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


def local_includes(source: str, kdir: Path | None = None) -> list[Path]:
    """`source` and every quoted #include it reaches inside `kdir`, recursively, sorted.

    Includes that do not exist in `kdir` (system headers, or emu/ headers referenced from
    branches NVRTC never takes but that do exist) are part of the result only if the file exists.
    """
    kdir = Path(kdir or kernel_dir())
    seen: set[Path] = set()
    todo = [kdir / source]
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for name in _INCLUDE_RE.findall(path.read_text()):
            todo.append((path.parent / name).resolve())
    return sorted(seen)


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
    prog = _check(nvrtc.nvrtcCreateProgram((kdir / source).read_bytes(), source.encode(), 0, [], []),
                  "nvrtcCreateProgram")
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
# on-disk cache (shared by ranks) and run-time loading

def cache_dir() -> Path:
    """The kernel cache folder (created): $BURSTCU_CACHE_DIR, else ``$TMPDIR/burstcu-<uid>``.

    The default is node-local and per user (mode 0700; see the module docstring for why not
    ~/.cache). Raises RuntimeError when that folder exists but belongs to another user.
    """
    override = os.environ.get("BURSTCU_CACHE_DIR")
    if override:
        path = Path(override)
        path.mkdir(parents=True, exist_ok=True)
        return path
    uid = os.getuid()
    path = Path(os.environ.get("TMPDIR") or "/tmp") / f"burstcu-{uid}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != uid:
        raise RuntimeError(f"the kernel cache folder {path} belongs to another user; set "
                           f"BURSTCU_CACHE_DIR to a folder of your own")
    return path


def cache_key(source: str, name_expressions: Sequence[str], arch: str,
              extra_options: Sequence[str] = (), kdir: Path | None = None) -> str:
    """Everything that specializes a CUBIN: sources + headers, options, arch, instantiations,
    and the NVRTC version."""
    from cuda.bindings import nvrtc

    kdir = Path(kdir or kernel_dir())
    parts = {
        "source": source, "digest": source_digest(source, kdir), "arch": arch,
        "options": list((*BASE_OPTIONS, *extra_options)), "names": list(name_expressions),
        "nvrtc": list(_check(nvrtc.nvrtcVersion(), "nvrtcVersion")),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cached_cubin(source: str, name_expressions: Sequence[str], arch: str,
                 extra_options: Sequence[str] = (), kdir: Path | None = None) -> tuple[Path, dict[str, str]]:
    """(path of the CUBIN, {name expression: lowered name}), compiling at most once per key.

    Ranks sharing the cache folder serialize on a file lock: the first compiles and writes the
    entry atomically (temp file + rename), the others find it when they get the lock.
    """
    from filelock import FileLock

    key = cache_key(source, name_expressions, arch, extra_options, kdir)
    root = cache_dir()
    cubin_path, meta_path = root / f"{key}.cubin", root / f"{key}.json"
    with FileLock(str(root / f"{key}.lock")):
        if not (cubin_path.exists() and meta_path.exists()):
            compiled = nvrtc_compile(source, name_expressions, arch, extra_options, kdir)
            _atomic_write(cubin_path, compiled.cubin)
            _atomic_write(meta_path, json.dumps({"lowered": compiled.lowered, "arch": arch,
                                                 "source": source, "log": compiled.log}).encode())
        lowered = json.loads(meta_path.read_text())["lowered"]
    return cubin_path, lowered


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# cudaDeviceAttr values (CUDA runtime, driver_types.h)
ATTR_CC_MAJOR, ATTR_CC_MINOR, ATTR_SMEM_PER_BLOCK_OPTIN = 75, 76, 97


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
_FUNCTIONS: dict[tuple, object] = {}  # (source, name, options, device) -> RawKernel, per process


def get_function(source: str, name_expression: str, smem_bytes: int = 0,
                 extra_options: Sequence[str] = (), device_id: int | None = None):
    """A `cupy.RawKernel` for one instantiation on a CuPy device (the current one by default).

    Compiled lazily for the device's own arch, through the disk cache, memoized per (source
    digest, options, arch, device). `smem_bytes` > 48 KB raises the kernel's dynamic-smem limit,
    which launches above 48 KB require. Later calls in the process are one dict lookup (sources
    are not re-hashed per launch).
    """
    import cupy

    device_id = cupy.cuda.Device().id if device_id is None else device_id
    fast_key = (source, name_expression, tuple(extra_options), device_id)
    fn = _FUNCTIONS.get(fast_key)
    if fn is not None:
        return fn
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

# Per-arch limits the gate checks and bench/ptxas_report.py computes occupancy from (CUDA
# programming guide, "Technical Specifications per Compute Capability").
ARCH_LIMITS = {
    "sm_80": {"regs_per_sm": 65536, "smem_per_sm": 164 * 1024, "smem_per_block": 163 * 1024,
              "threads_per_sm": 2048, "blocks_per_sm": 32, "gpu": "A100"},
    "sm_90": {"regs_per_sm": 65536, "smem_per_sm": 228 * 1024, "smem_per_block": 227 * 1024,
              "threads_per_sm": 2048, "blocks_per_sm": 32, "gpu": "H100"},
    # The "sm_86" table serves cc 8.6/8.7/8.9/12.x; the limits are sm_86's (cc 8.9 allows 24
    # blocks an SM, 12.0 32: a block-count bound never binds for these kernels).
    "sm_86": {"regs_per_sm": 65536, "smem_per_sm": 100 * 1024, "smem_per_block": 99 * 1024,
              "threads_per_sm": 1536, "blocks_per_sm": 16, "gpu": "RTX 3090/4090, L40S"},
}
MAX_REGISTERS = 255


def gate_variant(variant, arch: str) -> dict:
    """Compile one KernelVariant for `arch` with the ptxas report; a JSON-ready record.

    Keys: name, family, arch, dtype, headdim, threads, registers, spill_stores, spill_loads,
    stack_bytes, static_smem_bytes, dynamic_smem_bytes, smem_bytes (static + dynamic),
    compile_seconds, error (None, or the reason the variant fails the gate).
    """
    record = {"name": variant.name, "family": variant.family, "arch": arch, "dtype": variant.dtype,
              "headdim": variant.headdim, "threads": variant.launch.threads,
              "dynamic_smem_bytes": variant.launch.smem_bytes, "error": None}
    try:
        compiled = nvrtc_compile(variant.source, [variant.name], arch, ptxas_verbose=True)
    except (CompileError, OSError) as exc:
        record["error"] = str(exc)
        return record
    res = compiled.resources.get(compiled.lowered[variant.name])
    if res is None:
        record["error"] = f"no ptxas report for {compiled.lowered[variant.name]}"
        return record
    record.update(registers=res.registers, spill_stores=res.spill_stores, spill_loads=res.spill_loads,
                  stack_bytes=res.stack_bytes, static_smem_bytes=res.static_smem_bytes,
                  smem_bytes=res.static_smem_bytes + variant.launch.smem_bytes,
                  compile_seconds=round(compiled.seconds, 3))
    record["error"] = gate_failure(record)
    return record


def gate_failure(record: dict) -> str | None:
    """Why a compiled record fails the gate (spills, registers, smem over the arch), or None."""
    limits = ARCH_LIMITS.get(record["arch"])
    # careful variants run only where Inf/NaN meets masked pairs (variants.careful_variant):
    # their spills are in the record, not a failure
    if (record["spill_stores"] or record["spill_loads"]) and not record["family"].endswith(CAREFUL_SUFFIX):
        return f"spills {record['spill_stores']} B stored / {record['spill_loads']} B loaded"
    if record["registers"] > MAX_REGISTERS:
        return f"{record['registers']} registers > {MAX_REGISTERS}"
    if limits and record["smem_bytes"] > limits["smem_per_block"]:
        return f"{record['smem_bytes']} B smem > {limits['smem_per_block']} B per block on {record['arch']}"
    return None
