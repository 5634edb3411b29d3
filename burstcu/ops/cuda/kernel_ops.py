"""LocalOps on the CUDA kernels of kernels/: on a GPU through CuPy, or on the CPU through the emulator.

Both backends run the same launch code: only `xp` (cupy or numpy) and `function(name)` differ.
`function` returns a callable with CuPy RawKernel's convention ``fn(grid, block, args,
shared_mem=0)``; every kernel takes one argument, its parameter struct (kernels/params.cuh) as a
numpy.void scalar that `burstcu.ops.cuda.params` builds (one builder per struct):

* ``"cupy"``: `burstcu.build.compile.get_function` (NVRTC -> CUBIN, disk cache, RawModule);
* ``"emulated"``: `burstcu.build.emulate.build_module` (g++ + kernels/emu/cuda_emu.h).

Shapes (see `burstcu.ops.base`): q (B, S, H, D); k, v (B, Sk, Hkv, D); lse (B, H, S). Inputs are
float16 or bfloat16 (the kernels' types). Head dims: 32, 64, 96, 128, 256 run natively; any other
D <= 256 runs the next native one with q/k/v zero-padded in the last dim (zeros change neither
q.k nor the kept output columns); the softmax scale stays 1/sqrt(D) of the caller's D.

The forward state stays on the device between ring steps: acc (B, S, H, Dp) fp32, m, l (B, H, S)
fp32 (m, l in base-2 units, see kernels/README.md); each `forward_step` launch folds one Block into
it (the merge is fused in the kernel), `forward_finalize` divides.
The backward entry points delegate to `burstcu.ops.cuda.backward` with this object as `ops`.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...build.fwd_variants import (FINALIZE_VEC, LIST_FAMILY, SM90_FAMILY, SM90_LIST_FAMILY,
                                  careful_twin, nonfinite_flag_variant)
from ...build import all_variants
from ...build.bwd_variants import (LIST_SUFFIX, SM90_BULK_HEADDIMS, SM90_DKDV_BULK, SM90_DKDV_FAMILIES,
                                   SM90_DKDV_HEADDIMS, SM90_DQ_ADDS)
from ...build.compile import (ATTR_SM_COUNT, ATTR_SMEM_PER_BLOCK_OPTIN, BuildTimeoutError,
                               compute_capability, device_attribute, get_function, nvrtc_version,
                               setmaxnreg_registers)
from ...build.variants import MIN_COMPUTE_CAPABILITY, SMEM_PER_BLOCK, KernelVariant, base_table, kernel_dir
from ...layout import Block
from ...build import emulate
from ...transport.streams import nvtx_range
from ..base import LocalOps, caller_stacklevel, checked_option, dtype_name
from . import backward, decode
from .params import (I32_MAX, MAX_GRID_YZ, MAX_POSITION, StepGroups, any_masked, block_area,
                     block_column, cdiv, check_rows, fwd_finalize_params, fwd_step_params,
                     fwd_step_sm90_params, listable, nonempty, nonfinite_params, rows_on_16_bytes,
                     step_group_lists, vector_ready)
from .tensor_map import tensor_map_4d_rows

_KERNEL_DTYPES = ("float16", "bfloat16")
_OUT_DTYPES = ("float16", "bfloat16", "float32")  # flash_fwd_finalize instantiations
_MAX_HEADDIM = 256
_LOG2E = 1.4426950408889634
BACKENDS = ("cupy", "emulated")
DEVICE_OF = {"cupy": "cuda", "emulated": "cpu"}   # where each backend's arrays live
# Blocks of a persistent launch (forward_sm90) under the emulator: a few, so that every block
# runs several tiles and the pipelines carry their phases from tile to tile, as on a GPU.
_EMULATED_SM_COUNT = 3
# (device, Hopper variant name) -> whether it passed its first-use check on that device
# (`KernelOps._sm90_checked`): while the Hopper kernels have run on one GPU model only (an H200),
# a wrong result must fall back to the mma.sync kernels with a warning, never reach a model
_SM90_FIRST_USE: dict[tuple[int, str], bool] = {}
# (device, Hopper variant name) whose loaded kernels start with the registers their setmaxnreg
# split hands out (`KernelOps._registers_problem`): read once a process
_SM90_REGISTERS_READ: set[tuple[int, str]] = set()
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# cudaError_t values after which a context runs nothing more (illegal address, launch timeout,
# device assert, stack error, illegal instruction, misaligned address, invalid address space,
# invalid PC, launch failure): a first-use check meeting one cannot fall back to other kernels
STICKY_CUDA_ERRORS = frozenset({700, 702, 710, 714, 715, 716, 717, 718, 719})
# Which kernel runs a ring step's Blocks on the sm_90a table (`KernelOps._sm90_runs`): the Hopper
# kernel, a launch a Block, when the step has at most SM90_MAX_RECTS Blocks (a step without
# documents has 1 or 2) or when its Blocks are large, at least SM90_MIN_FLOP_PER_RECT of work each
# on average (4 x q_len x k_len x D x H x B, masked pairs included); else a rectangle-list
# kernel, one launch: the Hopper one (flash_fwd_steps_sm90; dK/dV: flash_bwd_dkdv_steps_sm90,
# `KernelOps.sm90_lists`), or the mma.sync one (flash_fwd_steps, flash_bwd_dkdv_steps) with
# sm90_lists False, the choice the numbers below measured (the backward's lists on the Hopper
# kernel in run7: 47.6 ms a list against 1.71 s a launch a rectangle, step_lists.json).
# Measured on an H200 (bench/results/h200/run2, step_lists*.json): 241
# documents over 4 ranks, 8676 rectangles, 1.32 s through the Hopper kernel (host-bound: 0.13 ms a
# launch, three tensor maps encoded each time) against 30 ms through the list kernel. The work
# threshold is where, at the measured rates (Hopper ~435, list ~165 TFLOP/s at d = 128) a launch's
# host cost is won back (W x (1/165 - 1/435) / 1e12 s = 0.13 ms at W = 3.5e10 FLOP), lowered to 2e10: a
# launch's host work overlaps the previous kernel (a PREDICTION: no step of large documents timed).
SM90_MAX_RECTS = 4
SM90_MIN_FLOP_PER_RECT = 2e10
# Native head dims at which the backward on the sm_90a table runs dQ in its own pass (the Hopper
# dK/dV kernel without dQ, then flash_bwd_dq) even where atomics are allowed: at 256 that pair ran
# fwd+bwd 1.2-1.45x faster than the Hopper kernel's atomic dQ at S = 4K and 16K (1.01-1.19x at 1K),
# at 64 and 128 0.90-1.03x of it (bench/results/h200/run7, kernels_bwd_sm90.json: its
# deterministic rows against the atomic ones).
SM90_DQ_OWN_PASS_HEADDIMS = (256,)


@dataclass
class ForwardState:
    """Running forward state of one rank's queries.

    q: (B, S, H, Dp) input dtype, padded, contiguous.  acc: (B, S, H, Dp) float32.
    m, l: (B, H, S) float32 (base-2 running max / sum); all three None until a fold writes them
    (`KernelOps._state_buffers`: a pass of one fold never allocates them).  scale: softmax scale.
    headdim: the caller's D.  dtype: "float16" or "bfloat16".  keep: what a launch still reads
    (the rectangle lists of flash_fwd_steps), kept with the state until it is finalized.
    fresh: nothing folded yet, and acc, m, l not written (`KernelOps._materialize` zeroes them;
    a Hopper fold over every row writes them without reading).  result: (out, lse) where the
    pass's last fold wrote them itself (`KernelOps._fold`), else None.
    """

    q: Any
    scale: float
    headdim: int
    dtype: str
    acc: Any = None
    m: Any = None
    l: Any = None
    keep: list = field(default_factory=list)
    fresh: bool = True
    result: tuple | None = None


def _first_use_blocks(listed: bool) -> list[Block]:
    """The Blocks of a first-use check's step (`KernelOps._sm90_checked`, `_sm90_backward_checked`)
    over q rows [32, 352) and k rows [64, 384) (the tensor maps' base offsets): one causal Block
    of 320 rows, or, for a rectangle-list variant (`listed`), six small ones that take the list
    kernels: three key ranges and four query ranges, several shared in each grouping, causal and
    full, every range ending inside a tile."""
    if not listed:
        return [Block(32, 320, 64, 320, 0, 0, True)]
    return [Block(32, 90, 64, 100, 0, 0, True), Block(122, 70, 64, 100, 90, 0, False),
            Block(192, 100, 164, 130, 0, 0, True), Block(292, 60, 294, 90, 0, 0, False),
            Block(32, 90, 294, 90, 200, 0, False), Block(122, 70, 164, 130, 500, 0, True)]


def _refused(key: tuple, hopper: KernelVariant, what: str, why: str) -> bool:
    """False, recorded in _SM90_FIRST_USE under `key`, with a warning at the user's line that
    this process runs the mma.sync kernels for `hopper`."""
    _SM90_FIRST_USE[key] = False
    warnings.warn(f"burstcu: the Hopper {what} kernel {hopper.name} failed its first-use "
                  f"check on this GPU ({why}); this process runs the mma.sync kernels for "
                  f"it instead (please report it, with `python -m burstcu.selftest "
                  f"--full`)", RuntimeWarning, stacklevel=caller_stacklevel())
    return False


def _first_use_check(key: tuple, hopper: KernelVariant, what: str, run) -> bool:
    """Whether the Hopper `what` ("forward", "backward") kernel `hopper` passes its first-use check
    (`KernelOps._sm90_checked`, `_sm90_backward_checked`): `run()` runs it and the mma.sync
    kernels and returns (got, want) pairs of their results; each pair must agree within 8 eps of
    want's magnitude, and run() must not raise. The verdict is False while run() runs and is
    recorded in _SM90_FIRST_USE under `key` (none when run() is interrupted: the next use checks
    again); a failure warns (`_refused`), except a CUDA error that
    ends the context (STICKY_CUDA_ERRORS), which raises RuntimeError saying so."""
    _SM90_FIRST_USE[key] = False  # until it has passed
    error, worst = "", 0.0
    try:
        for got, want in run():
            got, want = _host64(got), _host64(want)
            err = float(np.abs(got - want).max()) if np.isfinite(got).all() else float("inf")
            worst = max(worst, err / (8 * _EPS[hopper.dtype] * float(np.abs(want).max())))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel
        if getattr(exc, "status", None) in STICKY_CUDA_ERRORS:   # no kernel runs after it
            _SM90_FIRST_USE.pop(key, None)
            raise RuntimeError(
                f"burstcu: the Hopper {what} kernel {hopper.name} failed its first-use check with "
                f"a CUDA error that leaves this process's GPU context unusable ({type(exc).__name__}"
                f": {exc}); please report it, with `python -m burstcu.selftest --full`. "
                f"burstcu.init(..., arch='sm_80') runs the mma.sync kernels instead") from exc
        error = f"{type(exc).__name__}: {exc}"
    except BaseException:
        _SM90_FIRST_USE.pop(key, None)
        raise
    if error or worst > 1.0:
        why = error or f"differs from the mma.sync kernels by {worst:.3g} x the tolerance"
        return _refused(key, hopper, what, why)
    _SM90_FIRST_USE[key] = True
    return True


def _host64(x) -> np.ndarray:
    """A NumPy or CuPy array as a float64 NumPy array."""
    return np.asarray(x.get() if hasattr(x, "get") else x, np.float64)


class KernelOps(LocalOps):
    """LocalOps whose steps are the CUDA kernels (see the module docstring).

    backend: "cupy" (a GPU) or "emulated" (the CPU emulator, NumPy arrays).
    arch: which kernel table to use ("sm_80", "sm_86", "sm_90" or "sm_90a", see
        `burstcu.build.variants.ARCHS`); default: the device's (`_device_table_arch`; a
        compute capability 9.0 GPU gets "sm_90a", the Hopper forward kernels) for cupy, sm_80
        for the emulator. The table picks tile sizes and, for "sm_90a", the Hopper forward
        family (head dims 64, 128, 256; kernels/flash_fwd_sm90.cu); kernels are compiled for the
        device's own arch, the Hopper ones for sm_90a. `arch="sm_80"` forces the mma.sync
        kernels on any GPU.
    deterministic: backward without atomics (see ops/cuda/backward.py).  randomize: the emulator shuffles
        thread order between barriers (finds races; slower).
    """

    def __init__(self, backend: str = "cupy", arch: str | None = None,
                 deterministic: bool = False, randomize: bool = False):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.backend, self.device = backend, DEVICE_OF[backend]
        self.name = f"kernels-{backend}"
        self.deterministic = checked_option("deterministic", deterministic, "flag")
        self.randomize = checked_option("randomize", randomize, "flag")
        if self.device == "cuda":
            import cupy

            self.xp = cupy
            self.device_id = int(cupy.cuda.runtime.getDevice())   # bound: see current_device
            self.arch = arch or _device_table_arch()
            self.smem_limit = _device_smem_limit()
            self.sm_count = device_attribute(ATTR_SM_COUNT)
            if self.arch == "sm_90a" and compute_capability() != 90:
                raise ValueError("arch 'sm_90a' (the Hopper kernels) needs a compute capability "
                                 f"9.0 GPU; this one is {compute_capability() / 10:.1f}")
        else:
            emulate.check_environment()   # the emulator's settings, read by its C runtime
            self.xp = np
            self.arch = arch or "sm_80"
            self.smem_limit = None   # the table's own, once the table is known to exist (below)
            self.sm_count = _EMULATED_SM_COUNT
        self.array_types = (self.xp.ndarray,)
        if self.device == "cuda":                  # CuPy arrays have no bfloat16
            self.array_dtypes = ("float16", "float32", "float64")
        self.first_use_check = self.device == "cuda"  # see _sm90_checked
        # (batch, head) pairs whose query tiles the Hopper kernel's grid takes together before the
        # next pairs' (fewer pairs at once share their K/V tiles in L2); None: all of them (the
        # order measured in bench/results/h200). bench/gpu/kernel_speed.py --sm90-head-group.
        self.sm90_head_group: int | None = None
        # a step of many small Blocks on the sm_90a table: the Hopper list kernels, forward and
        # dK/dV (True), or the mma.sync ones (False, for comparison; see SM90_MAX_RECTS)
        self.sm90_lists = True
        # a fold over every query row that is a pass's first or last: on the Hopper kernel it
        # starts from a fresh state without reading it and, the last, writes out and lse itself;
        # a pass of one fold on the mma.sync kernels runs flash_fwd_pass (True; `_fold`); or
        # every fold reads a zeroed state and flash_fwd_finalize ends the pass (False, for
        # comparison: a ring's middle step; bench/gpu/kernel_speed.py --impls step)
        self.whole_pass = True
        # a list step whose rectangles are many and small (documents): packed into the kernels'
        # tiles with per-row key runs where that runs fewer tiles (True; burstcu.ops.cuda.packing),
        # or a tile a rectangle (False, for comparison: one launch a rectangle's bits)
        self.pack_lists = True
        # the backward's dK/dV on the sm_90a table: the Hopper kernel where `hopper_backward`
        # allows it (True), or the mma.sync one (False, for comparison)
        self.sm90_backward = True
        # how the Hopper dK/dV kernel adds dQ where dq's rows sit on 16 bytes (one float an atomic
        # add elsewhere, and at head dim 256): "pairs", two floats an atomic add; "singles", one;
        # "bulk", the bulk family's tensor reductions through a shared staging tile (head dims 64
        # and 128). One of SM90_DQ_ADDS; bench/gpu/kernel_speed.py --dq-adds compares them.
        self.sm90_dq_adds = "pairs"
        # see `dq_own_pass` (() for comparison: the Hopper kernel's atomic dQ at every head dim)
        self.dq_own_pass_headdims: tuple[int, ...] = SM90_DQ_OWN_PASS_HEADDIMS
        # decode's split kernel: the tensor-core twin from this many query rows a kv head
        # (decode.MMA_MIN_ROWS; 16 for comparison: the CUDA-core kernel under 16)
        self.decode_mma_min_rows = decode.MMA_MIN_ROWS
        self._sm90_checking: set = set()   # Hopper backward variants whose first-use check runs
        self._variants: dict[str, KernelVariant] = {v.name: v for v in all_variants(self.arch)}
        if self.device != "cuda":   # the emulator holds a table to the GPUs it is for
            self.smem_limit = SMEM_PER_BLOCK[base_table(self.arch)]
        self._variant_of: dict[tuple, KernelVariant] = {}   # variant()'s answers (a fixed table)
        self._functions: dict[str, Any] = {}
        self._zero_flag = None

    dtypes = _KERNEL_DTYPES
    masks_windows = True  # Block.left / Block.right become the kernels' key bounds (lo, hi)
    max_positions = MAX_POSITION  # the kernels add bounds of 32-bit positions
    compiles_on_first_use = True  # NVRTC (cupy) or g++ (emulated), then the kernel cache

    def agreed_options(self) -> tuple:
        return (("deterministic", self.deterministic),)   # which backward kernels run

    def current_device(self) -> int | None:
        """CuPy's current device. The op is bound to `device_id`, where it was made: its kernel
        objects (loaded and given their shared memory there), kept buffers, flags and device
        attributes are that device's, so a call with another device current is refused
        (`arrays.device_problem`); a process computing on several GPUs with group=None gets
        one op a device (`group.local_group`)."""
        return int(self.xp.cuda.runtime.getDevice()) if self.device == "cuda" else None

    def input_problem(self, q, k, backward: bool = False) -> str | None:
        # forward and backward kernels take 64-bit strides: no limit on the element count; their
        # grids put H (or Hkv) in y and B in z
        b, _, h, _ = q.shape
        if max(b, h) > MAX_GRID_YZ:
            what = f"batch {b}" if b > MAX_GRID_YZ else f"{h} heads"
            return (f"{what}: the CUDA kernels take at most {MAX_GRID_YZ} batch rows and heads a "
                    f"call (their grids' z and y); split the call")
        return self.headdim_problem(q.shape[-1], backward)

    def decode_problem(self, q_shape: tuple, k_shape: tuple, dtype: str) -> str | None:
        return decode.grid_problem(self, q_shape, k_shape, dtype)

    def headdim_problem(self, headdim: int, backward: bool = False) -> str | None:
        if not 0 < headdim <= _MAX_HEADDIM:
            return f"head dim {headdim} is not supported by the CUDA kernels: 1..{_MAX_HEADDIM}"
        if self.smem_limit is None:
            return None
        # the last guard: every table's variants fit the GPUs `_device_table_arch` maps to it,
        # but a table chosen by hand (arch=...) or an unlisted GPU may allow less
        families = ("forward", SM90_FAMILY) if self.arch == "sm_90a" else ("forward",)
        if backward:   # dQ in a pass of its own, or atomic; both where dq_own_pass prefers one
            own = ("bwd_dkdv_nodq", "bwd_dq")
            families = (own if self.deterministic else
                        ("bwd_dkdv",) + (own if self.dq_own_pass(headdim) else ()))
        for family in families:
            if family == SM90_FAMILY and self.forward_variant("float16", headdim).family != family:
                continue
            need = self.variant(family, "float16", headdim).launch.smem_bytes
            if need > self.smem_limit:
                return (f"head dim {headdim}: the {family} kernel needs {need} bytes of shared "
                        f"memory per block; this GPU allows {self.smem_limit}")
        return None

    def stream_key(self):
        """(the current CuPy stream or None under the emulator, the calling thread): kernels and
        buffer copies are issued on the stream; a GPU group of one runs several threads' calls
        as they come, on one stream too (CuPy's and torch's default), so what a call keeps
        (buffers, decode plans) is its thread's."""
        stream = self.xp.cuda.get_current_stream().ptr if self.device == "cuda" else None
        return stream, threading.get_ident()

    def annotate(self, label: str):
        """An NVTX range on a GPU (visible in Nsight Systems); nothing under emulation."""
        if self.device != "cuda":
            return super().annotate(label)
        return nvtx_range(label)

    # -- kernels -----------------------------------------------------------------------------------
    def function(self, name_expression: str):
        """The compiled kernel `name_expression` (an entry of all_variants(self.arch)), memoized."""
        fn = self._functions.get(name_expression)
        if fn is not None:
            return fn
        variant = self._variants.get(name_expression)
        if variant is None:
            raise KeyError(f"{name_expression!r} is not a variant for {self.arch}; "
                           f"see burstcu.build.all_variants")
        if self.device == "cuda":
            fn = get_function(variant.source, name_expression, smem_bytes=variant.launch.smem_bytes,
                              target=variant.target)
        else:
            if variant.launch.smem_bytes > self.smem_limit:   # a GPU of this table refuses it
                raise ValueError(f"{name_expression} takes {variant.launch.smem_bytes} bytes of "
                                 f"shared memory a block; the {self.arch} table's GPUs allow "
                                 f"{self.smem_limit}")
            module = emulate.build_module([str(kernel_dir() / variant.source)], [name_expression],
                                          randomize=self.randomize)
            fn = module.get_function(name_expression)
        self._functions[name_expression] = fn
        return fn

    def variant(self, family: str, dtype, headdim: int) -> KernelVariant:
        """The variant of `family` for `dtype` that runs head dim `headdim`: the smallest native
        head dim >= headdim (head-dim-agnostic variants, headdim 0, match any); headdim 0 asks
        for a head-dim-agnostic variant alone."""
        dtype = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        found = self._variant_of.get((family, dtype, headdim))
        if found is not None:
            return found
        if headdim == 0:   # a head-dim-agnostic family's variant (decode_merge: any head dim)
            fits = [v for v in self._variants.values() if v.family == family and v.dtype == dtype
                    and v.headdim == 0]
        elif not 0 < headdim <= _MAX_HEADDIM:
            raise ValueError(f"head dim {headdim} is not supported: the kernels run 1..{_MAX_HEADDIM}")
        else:
            fits = [v for v in self._variants.values() if v.family == family and v.dtype == dtype
                    and (v.headdim == 0 or v.headdim >= headdim)]
        if not fits:
            raise ValueError(f"no {family!r} kernel for {dtype} on {self.arch}")
        found = self._variant_of[(family, dtype, headdim)] = min(fits, key=lambda v: v.headdim)
        return found

    def forward_variant(self, dtype, headdim: int) -> KernelVariant:
        """The forward step that runs head dim `headdim`: on the "sm_90a" table the Hopper one
        (forward_sm90) when its native head dim (64, 128 or 256) is the smallest native one >=
        headdim, else the mma.sync one ("forward")."""
        plain = self.variant("forward", dtype, headdim)
        if self.arch != "sm_90a":
            return plain
        hopper = self.variant(SM90_FAMILY, dtype, headdim)
        if hopper.headdim != plain.headdim or not _SM90_FIRST_USE.get(self._first_use_key(hopper), True):
            return plain
        return hopper

    def _first_use_key(self, variant: KernelVariant) -> tuple[int, str]:
        return (self.device_id if self.device == "cuda" else -1, variant.name)

    def _registers_problem(self, hopper: KernelVariant) -> str | None:
        """Why the kernels of `hopper` (with, for a forward, its careful twin) would wait forever
        in setmaxnreg.inc, or None: on a GPU, each loaded function must start its threads with
        `setmaxnreg_registers` of its block's (cuFuncGetAttribute, CuPy's `num_regs`). The
        compile gate checks NVRTC 13.0's builds; an NVRTC of another version may allocate
        fewer. Nothing to read under the emulator, which has no register file."""
        if self.device != "cuda":
            return None
        variants = [hopper]
        twin = careful_twin(hopper) if hopper.family in (SM90_FAMILY, SM90_LIST_FAMILY) else None
        if twin is not None and twin.name in self._variants:   # a twin out of the table never runs
            variants.append(twin)
        for variant in variants:
            registers = int(self.function(variant.name).num_regs)
            want = setmaxnreg_registers(variant.launch.threads)
            if registers != want:
                return (f"{variant.name} was built with {registers} registers a thread where its "
                        f"setmaxnreg split needs {want}: it would wait forever (NVRTC "
                        f"{'.'.join(map(str, nvrtc_version()))}; the kernels are gated with 13.0)")
        return None

    def _sm90_usable(self, hopper: KernelVariant, what: str) -> bool | None:
        """The verdict on `hopper` already reached on this device (False, or True once it passed
        its first-use check), False now if its registers cannot run it or it cannot be compiled
        and loaded (`_registers_problem`; warned, `_refused`), True with the first-use check off,
        else None: its first-use check is to run. A
        compile past its deadline (BuildTimeoutError) and a CUDA error that leaves the context
        unusable (STICKY_CUDA_ERRORS: an earlier launch's, met here) raise, with no verdict."""
        key = self._first_use_key(hopper)
        if key in _SM90_FIRST_USE:
            return _SM90_FIRST_USE[key]
        if key not in _SM90_REGISTERS_READ:
            try:
                problem = self._registers_problem(hopper)
            except BuildTimeoutError:
                raise   # the compile's deadline ends the process (or aborts the group) as anywhere
            except Exception as exc:  # noqa: BLE001 - a kernel that does not load is not used
                if getattr(exc, "status", None) in STICKY_CUDA_ERRORS:
                    raise   # an earlier launch's error, met here: no kernel runs after it
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                return _refused(key, hopper, what, problem)
            _SM90_REGISTERS_READ.add(key)
        return None if self.first_use_check else True

    def _sm90_checked(self, hopper: KernelVariant, dtype) -> bool:
        """On a GPU, the first use of a Hopper variant on a device runs it against the mma.sync
        kernel of the same head dim; if they differ by more than two correct kernels do (8 eps
        of the output's magnitude), or the Hopper launch raises, it warns and this process keeps
        the mma.sync kernel for that variant (`forward_variant`). The case: B = 2, H = 4 on
        Hkv = 2, `_first_use_blocks` (a causal block of 320 rows; for the list variant six small
        ones against the mma.sync list kernel), on a grid of 2 blocks (the pipelines' phases
        carried from tile to tile), once clean and once with NaN in V before the blocks (the
        careful twins run). `first_use_check` (True on a GPU, False under the emulator, whose
        runs the tests check) turns it on or off. Before any of it, a kernel whose registers
        could not run its setmaxnreg split is refused (`_sm90_usable`); a kernel that hangs
        otherwise is not caught here."""
        key = self._first_use_key(hopper)
        known = self._sm90_usable(hopper, "forward")
        if known is not None:
            return known
        xp, d, n = self.xp, hopper.headdim, 320
        rng = np.random.default_rng(0)

        def rand(rows, heads):
            x = rng.standard_normal((2, rows, heads, d), dtype=np.float32)
            return xp.asarray(x).astype(dtype)

        q, k, v = rand(n + 32, 4), rand(n + 64, 2), rand(n + 64, 2)
        poisoned = v.copy()
        poisoned[:, :64] = float("nan")
        listed = hopper.family == SM90_LIST_FAMILY
        # (Blocks, last): the step's, and (not listed) a pass of one fold over every query row
        # (`_fold`: a fresh state not read, out and lse written by the step; the mma.sync side
        # runs flash_fwd_pass where its table has one), keys past the NaNs
        cases = [(_first_use_blocks(listed), False)]
        if not listed:
            cases.append(([Block(0, n + 32, 64, n, 0, 0, True)], True))
        plain = self.variant("forward", hopper.dtype, d)

        def run():
            saved, pairs = (self.sm_count, self.whole_pass), []
            try:
                self.sm_count, self.whole_pass = 2, True   # the whole pass checked, always
                for values, (blocks, last) in itertools.product((v, poisoned), cases):
                    results = []
                    for variant in (hopper, plain):
                        state = self.forward_init(q)
                        self._fold(variant, state, k, values, blocks, last)
                        results.append(self.forward_finalize(state, np.float32))
                    (out, lse), (want, want_lse) = results
                    pairs.append((out, want))
                    if last:   # every row sees a key: lse finite
                        pairs.append((lse, want_lse))
            finally:
                self.sm_count, self.whole_pass = saved
            return pairs
        return _first_use_check(key, hopper, "forward", run)

    # -- masked pairs and non-finite inputs --------------------------------------------------------
    def nonfinite_flag(self, *tensors):
        """A fresh device int32 (1,): nonzero if any of `tensors` ((B, S, H, D) float16/bfloat16
        with a contiguous last dim, or (B, H, S) float32 row statistics) holds a value that could
        make a product at a masked pair non-finite (kernels/flash_fwd.cu, flash_any_nonfinite).
        Launched on the current stream; nothing waits for it on the host."""
        flag = self.xp.zeros((1,), dtype=np.int32)
        for x in tensors:
            if x.size == 0:
                continue
            x4 = x.transpose(0, 2, 1)[..., None] if x.ndim == 3 else x    # (B, S, H, D)
            variant = nonfinite_flag_variant(dtype_name(x))
            threads = variant.launch.threads
            B, S, H, D = x4.shape
            vec = 16 // x4.itemsize
            if D % vec or not rows_on_16_bytes(x4):
                vec = 1
            if S * D // vec > I32_MAX:
                raise ValueError(f"{S} x {D} elements a head: beyond the flag kernel's int32 index")
            self.function(variant.name)((cdiv(S * D // vec, threads), H, B), (threads,),
                                        (nonfinite_params(x4, flag, vec),))
        return flag

    def zero_flag(self):
        """A device int32 (1,) that stays 0: the flag of launches whose block has no masked pair."""
        if self._zero_flag is None:
            self._zero_flag = self.xp.zeros((1,), dtype=np.int32)
            # it is filled on the stream current now and read later on any stream: once, wait
            # for the fill, or a launch on another stream could read it first
            self.sync()
        return self._zero_flag

    def step_flag(self, masked: bool, flag):
        """The non-finite flag a step launch reads: `flag` (from `nonfinite_flag`) for a block
        with masked pairs, else the flag that stays 0 (`zero_flag`)."""
        return flag if masked else self.zero_flag()

    def launch_step(self, variant: KernelVariant, grid, params, masked: bool) -> None:
        """Launch a step kernel with its parameter struct `params`, whose non-finite flag is
        `step_flag(masked, ...)`. A block with masked pairs (`masked`) gets the pair plain +
        careful, of which exactly one runs (the careful one when the flag is set: a NaN where a
        row cannot see must not reach it); any other block the plain kernel alone. Each runs
        with its own launch configuration (the Hopper careful twin needs more shared memory)."""
        runs = [variant]
        if masked:
            twin = careful_twin(variant)
            runs.append(self._variants.get(twin.name, twin))  # the table's own entry when it has one
        for v in runs:
            self.function(v.name)(grid, (v.launch.threads,), (params,), shared_mem=v.launch.smem_bytes)

    def _ready(self, x):
        """x, or an aligned contiguous copy, so the kernels can read it with 16-byte cp.async."""
        return vector_ready(self.xp, x)

    def pad_headdim(self, x, padded: int):
        """x (..., D) zero-padded to (..., padded) as a fresh contiguous array; x itself if D ==
        padded."""
        d = x.shape[-1]
        if d == padded:
            return x
        if d > padded:
            raise ValueError(f"cannot pad head dim {d} down to {padded}")
        out = self.xp.zeros((*x.shape[:-1], padded), dtype=x.dtype)
        out[..., :d] = x
        return out

    def unpad_headdim(self, x, d: int):
        """x (..., Dp) -> (..., d) (a view; x itself if Dp == d)."""
        return x if x.shape[-1] == d else x[..., :d]

    def sync(self) -> None:
        if self.device == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale: float | None = None) -> ForwardState:
        """Fresh state for q (B, S, H, D), acc 0, m -inf, l 0 once a fold reads it (until then
        neither allocated nor written: `ForwardState.fresh`, `_state_buffers`); scale defaults
        to 1/sqrt(D)."""
        dtype = self._check_dtype(q, "q")
        D = q.shape[3]
        dp = self.variant("forward", dtype, D).headdim
        scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
        return ForwardState(q=self._ready(self.pad_headdim(q, dp)), scale=scale, headdim=D,
                            dtype=dtype)

    def _unwritten(self, *shapes_dtypes) -> list:
        """Fresh arrays of (shape, dtype), not written (the emulator fills them with NaN, so that
        a kernel that reads one before writing it, or leaves a row of it unwritten, shows)."""
        arrays = [self.xp.empty(shape, dtype=dtype) for shape, dtype in shapes_dtypes]
        if self.device == "cpu":   # the emulator's arrays, on the host
            for x in arrays:
                x.fill(np.nan)
        return arrays

    def _state_buffers(self, state: ForwardState) -> None:
        """state.acc (B, S, H, Dp), m, l (B, H, S) float32 allocated, unwritten (`_unwritten`)."""
        if state.acc is None:
            B, S, H, dp = state.q.shape
            state.acc, state.m, state.l = self._unwritten(((B, S, H, dp), np.float32),
                                                          *[((B, H, S), np.float32)] * 2)

    def _materialize(self, state: ForwardState) -> None:
        """A fresh state's acc 0, m -inf, l 0 written, for a fold that reads them."""
        self._state_buffers(state)
        if state.fresh:
            state.acc.fill(0)
            state.m.fill(-np.inf)
            state.l.fill(0)
            state.fresh = False

    def forward_step(self, state: ForwardState, k, v, blocks: Sequence[Block], last: bool = False) -> None:
        """Fold attention over (k, v) (B, Sk, Hkv, D) rows in `blocks` into `state` (`last`: no
        step follows before forward_finalize; see `_fold` for what the Hopper kernel does with
        it and with a fresh state): one launch
        for the whole step (flash_fwd_steps over the rectangle list, grouped by query range,
        each group's blocks folding in order) or, for one Block, flash_fwd_step. On the sm_90a
        table the Hopper kernel (forward_sm90) runs the step a launch a Block (launches on one
        stream run in order, so blocks sharing query rows compose) when `_sm90_runs` says so;
        a list of many small Blocks (documents) runs in one launch, whose cost beats the Hopper
        launches' host cost there (bench/results/h200/README.md): flash_fwd_steps_sm90 (the
        Hopper list kernel), or flash_fwd_steps with `sm90_lists` False (`_sm90_choice`)."""
        if state.result is not None:
            raise RuntimeError("forward_step after the step its caller said was the last")
        blocks = nonempty(blocks)
        if not blocks:
            return
        self._check_kv(state, k, v)
        variant = self.forward_variant(state.dtype, state.headdim)
        if variant.family == SM90_FAMILY:
            variant = self._sm90_choice(variant, state, blocks)
        self._fold(variant, state, k, v, blocks, last)

    def _sm90_choice(self, hopper: KernelVariant, state: ForwardState,
                     blocks: Sequence[Block]) -> KernelVariant:
        """The kernel of a step on the sm_90a table: `hopper` a launch a Block where `_sm90_runs`;
        a longer list of small Blocks whose query ranges are equal or disjoint the Hopper list
        kernel (forward_sm90_list, with `sm90_lists`); else the mma.sync kernels."""
        plain = self.variant("forward", state.dtype, state.headdim)
        if not (state.scale > 0 and self._sm90_checked(hopper, state.q.dtype)):
            return plain
        if self._sm90_runs(blocks, state.q.shape, state.scale):
            return hopper
        if self.sm90_lists and listable(blocks, ["query"]):
            listed = self.variant(SM90_LIST_FAMILY, state.dtype, state.headdim)
            return listed if self._sm90_checked(listed, state.q.dtype) else plain
        return plain

    @staticmethod
    def _sm90_runs(blocks: Sequence[Block], q_shape: tuple, scale: float) -> bool:
        """Whether a Hopper kernel takes a step of `blocks` over queries of `q_shape` (B, S, H, D)
        (SM90_MAX_RECTS, SM90_MIN_FLOP_PER_RECT): the forward folds the scale into its exponent
        after a max over raw scores, the backward masks scores to -inf before scaling, which both
        need a softmax scale > 0 (0 or below: the mma.sync kernels, which scale first)."""
        if not scale > 0:
            return False
        if len(blocks) <= SM90_MAX_RECTS:
            return True
        B, _, H, D = q_shape
        area = block_area(blocks)
        return 4.0 * D * H * B * area / len(blocks) >= SM90_MIN_FLOP_PER_RECT

    def dq_own_pass(self, headdim: int) -> bool:
        """Whether the backward prefers dQ in a pass of its own (flash_bwd_dq after the dK/dV
        kernel without dQ) to fp32 atomics inside the dK/dV kernel: in the deterministic mode, and
        on the sm_90a table with the Hopper backward on where the head dim runs natively at one of
        `dq_own_pass_headdims` (SM90_DQ_OWN_PASS_HEADDIMS: where that is faster), which a step
        takes where the Hopper kernel without dQ runs it (`backward.step_kernels`)."""
        if self.deterministic:
            return True
        return (self.arch == "sm_90a" and self.sm90_backward
                and self.variant("bwd_dkdv", "float16", headdim).headdim in self.dq_own_pass_headdims)

    def hopper_backward(self, family: str, dtype: str, headdim: int, blocks: Sequence[Block],
                        q_shape: tuple, scale: float,
                        tiled: Sequence[str] = ("key",)) -> KernelVariant | None:
        """The Hopper dK/dV step (kernels/flash_bwd_sm90.cu) that takes the place of `family`
        ("bwd_dkdv" or "bwd_dkdv_nodq") for a step of `blocks`: a launch a Block where
        `_sm90_runs`, else, with `sm90_lists`, its rectangle-list kernel (family + LIST_SUFFIX) for
        a step whose Blocks are `listable` by every range of `tiled` (the step's kernels: "key",
        and "query" where the mma.sync dQ list kernel runs beside it). None where the mma.sync
        kernels run the step: another tile table than "sm_90a", `sm90_backward` off, a head dim the
        Hopper family does not run natively (it runs 64, 128 and 256; the mma.sync family's native
        head dim decides, as `forward_variant` does), a scale <= 0, or neither case above."""
        if self.arch != "sm_90a" or not self.sm90_backward:
            return None
        if self.sm90_dq_adds not in SM90_DQ_ADDS:
            raise ValueError(f"KernelOps.sm90_dq_adds is {self.sm90_dq_adds!r}: choose from {SM90_DQ_ADDS}")
        one_block = SM90_DKDV_FAMILIES[family == "bwd_dkdv"]
        plain = self.variant(family, dtype, headdim)
        if plain.headdim not in SM90_DKDV_HEADDIMS or not scale > 0:
            return None
        if family == "bwd_dkdv" and self.sm90_dq_adds == "bulk" and plain.headdim in SM90_BULK_HEADDIMS:
            one_block = SM90_DKDV_BULK
        listed = not self._sm90_runs(blocks, q_shape, scale)
        if listed and not (self.sm90_lists and len(blocks) > 1 and listable(blocks, tiled)):
            return None
        # the one-Block kernel's first-use check, then (a list) the list kernel's own
        for name in [one_block] + ([one_block + LIST_SUFFIX] if listed else []):
            hopper = self.variant(name, dtype, headdim)
            if not self._sm90_backward_checked(hopper):
                return None
        return hopper

    def _sm90_backward_checked(self, hopper: KernelVariant) -> bool:
        """`_sm90_checked` for the Hopper backward: the first use of `hopper` on a device runs a
        backward step with it and with the mma.sync kernels (B = 2, H = 4 on Hkv = 2,
        `_first_use_blocks`: a causal block of 320 rows, six small ones for a list variant; lse
        drawn near the scores' log-sum-exp); dq, dk and dv must agree within 8 eps of each one's
        magnitude, else it warns and this process keeps the mma.sync kernels for that variant."""
        key = self._first_use_key(hopper)
        if key in self._sm90_checking:
            return True   # the check's own step
        known = self._sm90_usable(hopper, "backward")
        if known is not None:
            return known
        xp, d, n = self.xp, hopper.headdim, 320
        rng = np.random.default_rng(0)

        def rand(*shape, dtype=hopper.dtype):
            return xp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

        q, dout = rand(2, n + 32, 4, d), rand(2, n + 32, 4, d)
        k, v = rand(2, n + 64, 2, d), rand(2, n + 64, 2, d)
        lse = xp.abs(rand(2, 4, n + 32, dtype=np.float32)) + np.float32(4)
        delta = rand(2, 4, n + 32, dtype=np.float32)
        blocks = _first_use_blocks(hopper.family.endswith(LIST_SUFFIX))

        def run():   # the check's own step runs `hopper` (with dQ or without, as its family says)
            saved, grads = (self.sm90_backward, self.deterministic, self.dq_own_pass_headdims), []
            self._sm90_checking.add(key)
            try:
                self.dq_own_pass_headdims = ()   # the variant's own dQ mode, at any head dim
                for hopper_on in (True, False):
                    self.sm90_backward = hopper_on
                    self.deterministic = hopper.family.startswith(SM90_DKDV_FAMILIES[False])
                    ctx = self.backward_init(k, v, 1.0 / math.sqrt(d))
                    dq = xp.zeros(q.shape, dtype=np.float32)
                    self.backward_step(ctx, q, dout, lse, delta, dq, blocks)
                    grads.append((dq, *self.backward_finalize(ctx, np.float32)))
            finally:
                self.sm90_backward, self.deterministic, self.dq_own_pass_headdims = saved
                self._sm90_checking.discard(key)
            return list(zip(*grads))
        return _first_use_check(key, hopper, "backward", run)

    def _fold(self, variant: KernelVariant, state: ForwardState, k, v, blocks: Sequence[Block],
              last: bool = False) -> None:
        """forward_step's launches with the step kernel `variant`. One Block over every query row
        on the Hopper kernel neither reads a fresh state (it starts from acc 0, m -inf, l 0) nor,
        when `last`, writes the state: it writes out and lse as flash_fwd_finalize would
        (state.result), so that a pass of one fold (one rank, Ulysses) runs one kernel where it
        ran five (three zeroings, the fold, the finalize), and a ring's first and last folds skip
        a read and a write of the fp32 state. On the mma.sync tiles such a pass of one fold runs
        flash_fwd_pass (where the table has one: `_pass_variant`). Anything else zeroes a fresh
        state first (`_materialize`)."""
        B, S, H, dp = state.q.shape
        covers = self.whole_pass and len(blocks) == 1 and blocks[0].q_start == 0 and \
            blocks[0].q_len == S
        whole = covers and variant.family == SM90_FAMILY
        one_pass = (covers and variant.family == "forward" and state.fresh and last
                    and self._pass_variant(variant) is not None)   # flash_fwd_pass
        if not (whole or one_pass):
            self._materialize(state)
        elif not (state.fresh and last):
            self._state_buffers(state)   # written (fresh), or read and written
        kp = self._ready(self.pad_headdim(k, dp))
        vp = self._ready(self.pad_headdim(v, dp))
        if kp.strides != vp.strides:
            kp, vp = self.xp.ascontiguousarray(kp), self.xp.ascontiguousarray(vp)
        check_rows(blocks, S, k.shape[1])
        groups = None   # a list launch's rectangles: the Hopper list kernel's, or flash_fwd_steps'
        if variant.family == SM90_LIST_FAMILY:
            (groups,) = self.step_lists(blocks, [("query", variant.launch.block_m)])
        elif variant.family != SM90_FAMILY and len(blocks) > 1 and listable(blocks, ["query"]):
            variant = self.variant(LIST_FAMILY, state.dtype, variant.headdim)
            (groups,) = self.step_lists(blocks, [("query", variant.launch.block_m)])
        # a NaN/Inf in V at a key some row of a tile cannot see would reach that row through
        # 0 x Inf in the tensor cores; K's are masked out of the scores in every variant. A
        # packed list masks pairs by its rows' key runs, whatever the blocks say.
        masked = any_masked(blocks) or (groups is not None and groups.packed)
        if variant.family == SM90_LIST_FAMILY:
            # its maps cover the whole arrays: a key tile that runs past a rectangle's k_len holds
            # the next rows of v (masked out of P, but 0 x Inf = NaN), not the zeros of a map of
            # the rectangle alone, so such a list takes the careful pair as masked pairs do
            masked = masked or bool(np.any(block_column(blocks, "k_len") % variant.launch.block_n))
        flag = self.nonfinite_flag(vp) if masked else None
        if variant.family == SM90_FAMILY:
            for blk in blocks:
                self._forward_step_sm90(variant, state, kp, vp, blk, flag, whole and last)
            return
        if groups is not None:
            state.keep.append(groups)   # the rectangles stay until the step has run
        if variant.family == SM90_LIST_FAMILY:
            self._forward_steps_sm90(variant, state, kp, vp, groups, masked, flag)
            return
        if groups is not None:   # the whole step in one launch
            params = fwd_step_params(state.q, kp, vp, state.acc, state.m, state.l,
                                     self.step_flag(masked, flag), None, state.scale * _LOG2E,
                                     groups)
            self.launch_step(variant, (groups.tiles, H, B), params, masked)
            return
        if one_pass:
            (blk,) = blocks
            out, lse = self._pass_outputs(state)
            params = fwd_step_params(state.q, kp, vp, None, None, None,
                                     self.step_flag(blk.masked, flag), blk, state.scale * _LOG2E,
                                     out=out, lse=lse)
            self.launch_step(self._pass_variant(variant), (cdiv(blk.q_len, variant.launch.block_m), H, B),
                             params, blk.masked)
            state.fresh, state.result = False, (out, lse)
            return
        for blk in blocks:
            params = fwd_step_params(state.q, kp, vp, state.acc, state.m, state.l,
                                     self.step_flag(blk.masked, flag), blk,
                                     state.scale * _LOG2E)
            self.launch_step(variant, (cdiv(blk.q_len, variant.launch.block_m), H, B), params,
                             blk.masked)

    def _pass_variant(self, step: KernelVariant) -> KernelVariant | None:
        """flash_fwd_pass on the tiles of the forward step `step`, None where the table has none
        (fwd_variants.PASS_HEADDIMS)."""
        name = step.name.replace("flash_fwd_step<", "flash_fwd_pass<", 1)
        return self._variants.get(name) if name != step.name else None

    def _pass_outputs(self, state: ForwardState) -> tuple[Any, Any]:
        """(out (B, S, H, Dp) in state.dtype, lse (B, H, S) float32) for a fold that ends the pass
        (`_unwritten`)."""
        B, S, H, dp = state.q.shape
        out, lse = self._unwritten(((B, S, H, dp), state.dtype), ((B, H, S), np.float32))
        return out, lse

    def _forward_step_sm90(self, variant: KernelVariant, state: ForwardState, kp, vp, blk: Block,
                           flag, finalize: bool = False) -> None:
        """One Block through the Hopper kernel: tensor maps of the block's q, k and v rows, a
        persistent grid of min(tiles, SMs) blocks; a block with masked pairs issues the pair
        plain + careful (forward_sm90_careful), of which the nonfinite flag runs exactly one.
        A fresh state is not read (the Block covers every row: `_fold`); with `finalize` the
        kernel writes out (state.dtype) and lse into state.result instead of the state."""
        B, S, H, dp = state.q.shape
        out, lse = self._pass_outputs(state) if finalize else (None, None)
        cfg = variant.launch
        q_map = tensor_map_4d_rows(self.backend, state.q, blk.q_start, blk.q_len, cfg.block_m)
        k_map = tensor_map_4d_rows(self.backend, kp, blk.k_start, blk.k_len, cfg.block_n)
        v_map = tensor_map_4d_rows(self.backend, vp, blk.k_start, blk.k_len, cfg.block_n)
        n_tiles = cdiv(blk.q_len, cfg.block_m) * H * B
        hb_group = max(1, min(self.sm90_head_group or H * B, H * B))
        # a pass of one fold neither reads nor writes the state, which has no buffers: null
        # pointers (a kernel that followed one would fault at once)
        params = fwd_step_sm90_params(q_map, k_map, v_map, state.acc, state.m, state.l,
                                      self.step_flag(blk.masked, flag), blk, H, kp.shape[2],
                                      state.scale * _LOG2E, n_tiles, hb_group,
                                      fresh=state.fresh, out=out, lse=lse)
        self.launch_step(variant, (min(n_tiles, self.sm_count),), params, blk.masked)
        state.fresh = False
        if finalize:
            state.result = (out, lse)

    def _forward_steps_sm90(self, variant: KernelVariant, state: ForwardState, kp, vp,
                            groups: StepGroups, masked: bool, flag) -> None:
        """A step's Blocks in one launch of the Hopper list kernel (flash_fwd_steps_sm90): tensor
        maps of the whole q, k and v, the Blocks as `groups` (`step_lists`: by query range or
        packed, tiles of 128 rows), a persistent grid over the groups' query tiles x H x B."""
        B, S, H, dp = state.q.shape
        cfg = variant.launch
        q_map = tensor_map_4d_rows(self.backend, state.q, 0, S, cfg.block_m)
        k_map = tensor_map_4d_rows(self.backend, kp, 0, kp.shape[1], cfg.block_n)
        v_map = tensor_map_4d_rows(self.backend, vp, 0, vp.shape[1], cfg.block_n)
        n_tiles = groups.tiles * H * B
        hb_group = max(1, min(self.sm90_head_group or H * B, H * B))
        params = fwd_step_sm90_params(q_map, k_map, v_map, state.acc, state.m, state.l,
                                      self.step_flag(masked, flag), None, H, kp.shape[2],
                                      state.scale * _LOG2E, n_tiles, hb_group, groups)
        self.launch_step(variant, (min(n_tiles, self.sm_count),), params, masked)

    def forward_finalize(self, state: ForwardState, out_dtype) -> tuple[Any, Any]:
        """(out (B, S, H, D) in out_dtype, lse (B, H, S) float32); rows that saw no key: 0, -inf.
        Where the last fold wrote them (state.result, in the state's dtype), those, converted to
        out_dtype if it differs (the engines ask for q's dtype: no conversion; another dtype gets
        the values rounded to q's dtype first)."""
        xp = self.xp
        if state.result is not None:
            out, lse = state.result
            out = xp.ascontiguousarray(self.unpad_headdim(out, state.headdim))
            return (out if out.dtype == np.dtype(out_dtype) else out.astype(out_dtype)), lse
        self._materialize(state)
        out_name = np.dtype(out_dtype).name
        run_name = out_name if out_name in _OUT_DTYPES else "float32"
        B, S, H, dp = state.acc.shape
        out = xp.empty((B, S, H, dp), dtype=run_name)
        lse = xp.empty((B, H, S), dtype=np.float32)
        if out.size:
            variant = self.variant("forward_finalize", run_name, dp)
            threads = variant.launch.threads
            vec = FINALIZE_VEC if dp % FINALIZE_VEC == 0 and rows_on_16_bytes(state.acc, out) else 1
            params = fwd_finalize_params(state.acc, state.m, state.l, out, lse, vec)
            self.function(variant.name)((cdiv(S * dp // vec, threads), H, B), (threads,), (params,))
        out = xp.ascontiguousarray(self.unpad_headdim(out, state.headdim))
        if run_name != out_name:
            out = out.astype(out_dtype)
        return out, lse

    # -- backward (backward.py) ---------------------------------------------------------------------
    def backward_delta(self, dout, out):
        return backward.backward_delta(self, dout, out)

    def backward_init(self, k, v, softmax_scale: float):
        return backward.backward_init(self, k, v, softmax_scale)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks: Sequence[Block], psum=None) -> None:
        backward.backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum)

    def backward_finalize(self, ctx, out_dtype):
        return backward.backward_finalize(self, ctx, out_dtype)

    # -- decode (kernels/flash_decode.cu; other dtypes: the array-module default) ---------------------
    def decode_partial(self, q, k_cache, v_cache, lengths, scale, out=None):
        if dtype_name(q) not in decode.KERNEL_DTYPES:
            return super().decode_partial(q, k_cache, v_cache, lengths, scale, out)
        return decode.partial(self, q, k_cache, v_cache, lengths, scale, out)

    def decode_merge(self, parts, out_dtype):
        return decode.merge(self, parts, out_dtype)

    def decode_whole(self, q, k_cache, v_cache, lengths, scale, out_dtype):
        if dtype_name(q) not in decode.KERNEL_DTYPES:
            return super().decode_whole(q, k_cache, v_cache, lengths, scale, out_dtype)
        return decode.whole(self, q, k_cache, v_cache, lengths, scale, out_dtype)

    # -- argument checks and layout ----------------------------------------------------------------
    def _check_dtype(self, x, what: str) -> str:
        name = dtype_name(x)
        if name not in _KERNEL_DTYPES:
            raise ValueError(f"{what} is {name}: the CUDA kernels take float16 or bfloat16 "
                             f"(use the NumPy ops for float32/float64)")
        return name

    def _check_kv(self, state: ForwardState, k, v) -> None:
        for name, x in (("k", k), ("v", v)):
            if self._check_dtype(x, name) != state.dtype:
                raise ValueError(f"{name} is {dtype_name(x)}, q is {state.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"k has shape {tuple(k.shape)}, v {tuple(v.shape)}")
        B, _, H, _ = state.q.shape
        if k.ndim != 4 or k.shape[0] != B or k.shape[3] != state.headdim or H % k.shape[2]:
            raise ValueError(f"k/v of shape {tuple(k.shape)} do not fit q (B={B}, H={H}, "
                             f"D={state.headdim}): need (B, Sk, Hkv, D) with H a multiple of Hkv")

    def step_lists(self, blocks: Sequence[Block], groupings: list[tuple[str, int]]) -> tuple:
        """`step_group_lists` of `blocks` on this device (packed where `pack_lists` and packing
        pays). A `burstcu.layout.StepBlocks` (cached by `layout.blocks`, so every layer of a model
        meets a step's object again) has its lists kept while it lives, per (groupings,
        `pack_lists`, device, current stream): built and uploaded once,
        read by launches on the stream they were uploaded on (`release_buffers` frees them)."""
        if not hasattr(blocks, "memo"):
            return step_group_lists(self.xp, blocks, groupings, self.pack_lists)
        kept = self.__dict__.setdefault("_step_lists", weakref.WeakKeyDictionary())
        per_step = kept.setdefault(blocks, {})
        key = (tuple(groupings), self.pack_lists, self.current_device(), self.stream_key())
        if key not in per_step:
            per_step[key] = step_group_lists(self.xp, blocks, groupings, self.pack_lists)
        return per_step[key]

    def release_buffers(self) -> None:
        """Free the message buffers and the kept rectangle lists (`step_lists`)."""
        super().release_buffers()
        self.__dict__.pop("_step_lists", None)


def _device_table_arch() -> str:
    """The tile table for the current CuPy device (see `table_arch_for`)."""
    return table_arch_for(compute_capability())


def table_arch_for(cc: int) -> str:
    """The tile table for compute capability `cc` (major * 10 + minor, e.g. 86).

    The table sets tile sizes only; `burstcu.build.compile.get_function` compiles for the
    device's own arch, so an sm_120 device running the "sm_86" table gets an sm_120 CUBIN (an
    sm_86 CUBIN would not load there).
        8.0             sm_80  (A100, A30: 163 KB opt-in smem a block)
        8.6, 8.7, 8.9   sm_86  (A10, A40, RTX 30xx/40xx, Orin, L4, L40S: 99 KB)
        9.0             sm_90a (H100/H200: 227 KB; the Hopper forward kernels, wgmma + TMA)
        10.x            sm_90  (B200/GB200, cc 10.0: 227 KB; sm_90a code does not run there)
        >= 12.0         sm_86  (consumer Blackwell, RTX 50xx / RTX PRO, cc 12.x: 99 KB)
    Anything else at or above 8.0 (cc 11.x) gets the 99 KB table, the smallest. `headdim_problem`
    still checks each launch's smem against the device's real limit.
    """
    if cc < MIN_COMPUTE_CAPABILITY:
        raise RuntimeError(f"the burstcu kernels need compute capability >= 8.0 (cp.async, bf16 mma); "
                           f"this device is {cc // 10}.{cc % 10}")
    if cc == 80:
        return "sm_80"
    if cc == 90:
        return "sm_90a"
    if 90 < cc < 110:
        return "sm_90"
    return "sm_86"


def _device_smem_limit() -> int:
    """Shared memory one block may opt in to on the current CuPy device (bytes)."""
    return device_attribute(ATTR_SMEM_PER_BLOCK_OPTIN)
