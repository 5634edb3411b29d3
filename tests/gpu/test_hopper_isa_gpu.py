"""Bitwise probes that ask an H100 the PTX ISA questions the emulator answers from its reading.

The emulator's sm_90a primitives (kernels/emu/emu_hopper.h: TMA landing with swizzle and zero
fill; kernels/emu/emu_wgmma.h: wgmma descriptors, canonical layouts, register fragments) were
written from the PTX ISA and never checked on hardware. The probe kernels
(tests/gpu/hopper_isa_probes.cu, through kernels/hopper.cuh) ask exactly the questions
kernels/flash_fwd_sm90.cu depends on, each with a result the ISA fixes bit for bit:

* TMA: one box of `tma_load_4d` per swizzle mode (none / 32B / 64B / 128B), running past the
  tensor's end in dims 0 and 1, or before its start in dims 0, 1 and 2, and with rows narrower
  than the swizzle span; the raw shared bytes come back. The tensor's element bits name the
  element (1 + its linear index), so a wrong byte names the element that landed there.
* wgmma, with small nonzero integers (|x| <= 4) so that every product and every fp32 sum is
  exact in any order: S = Q K^T (ss, both K-major 128B-swizzled, the kernel's descriptors and
  +32 B k16 steps) for D in {64, 128, 256} and N in {64, 128}; O += P V (rs: P from registers, V
  N-major, LBO = BLOCK_N * 128, SBO = 1024, +2048 B k16 steps) for N = D in {64, 128, 256} and
  BLOCK_N in {64, 128}; each with scale-d false and true for the first wgmma. The operands are
  plain copies of bytes placed by `place_tile` here (no TMA); the `attn_tma` cases instead
  bring Q, K, V by TMA with the kernel's maps (`tensor_map_4d_rows`) and run S = Q K^T, the
  kernel's pack of S into A fragments, and O += P V, as flash_fwd_sm90.cu does.
* the register fragment tables: `frag_d` (S[m][n] = 256 m + n + 1, so each accumulator register
  names the (row, col) it holds) and `frag_a` (O[m][d] = A[m][d % 16] = 16 m + d % 16 + 1, so
  each register names the A element, hence the A register, the hardware took).

Every probe is compared with its NumPy model (`model`: written here from the ISA, not from the
emulator's C++) and, on a GPU, the GPU's raw output with the emulator's, bit for bit. The emulator
side always runs (CI keeps the probes compiling and the model honest; a few seconds); the GPU side
runs with BURSTCU_KERNEL_TEST_BACKEND=cupy on a compute capability 9.0 device (NVRTC for sm_90a
through burstcu.build.compile's disk cache) and skips otherwise. BURSTCU_ISA_REPORT=path.json
writes a JSON report of every probe (what it asks, its parameters, emulator vs model, GPU vs model,
GPU vs emulator, the first mismatches), rewritten after each test so that a run cut short keeps
what it did:

    BURSTCU_KERNEL_TEST_BACKEND=cupy BURSTCU_ISA_REPORT=hopper_isa.json python -m pytest -q
        tests/gpu/test_hopper_isa_gpu.py           (on one line; bench/gpu/run.sh's `isa` step)
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from burstcu.build.variants import kernel_dir
from burstcu.ops.cuda.tensor_map import tensor_map, tensor_map_4d_rows
from tests.kernels.tma_model import box_values

HERE = Path(__file__).resolve().parent
PROBES = HERE / "hopper_isa_probes.cu"
BACKEND = os.environ.get("BURSTCU_KERNEL_TEST_BACKEND", "emulated")
REPORT = os.environ.get("BURSTCU_ISA_REPORT")
CTYPE = {"f16": "__half", "bf16": "__nv_bfloat16"}
SENTINEL = 0x7FBADBAD  # a NaN: what an output register holds if the probe never wrote it
FIRST = 8              # mismatches listed per comparison in the report

i32 = np.int32

# ---------------------------------------------------------------------------------------------
# the probe cases


@dataclass(frozen=True)
class Case:
    name: str
    kind: str       # tma, qk, pv, frag_d, frag_a, attn_tma
    kernel: str     # the name expression of the probe kernel
    params: tuple   # (key, value) pairs, in the report

    @property
    def p(self) -> dict:
        return dict(self.params)


def _cases() -> list[Case]:
    """In run order: the fragment probes and the wgmma probes fed by plain copies first, TMA
    after them (a probe that faults on the GPU spoils the CUDA context for every later one, and
    the copy-fed wgmma probes depend on nothing else), the TMA-fed kernel path last."""
    cases = [Case("frag_d_n256", "frag_d", "probe_qk<__half, 256, 64>",
                  (("dtype", "f16"), ("N", 256), ("D", 64), ("scale_d_first", 0), ("qslice", 0))),
             Case("frag_a_n64", "frag_a", "probe_pv<__half, 64, 64>",
                  (("dtype", "f16"), ("D", 64), ("BLOCK_N", 64), ("scale_d_first", 0)))]
    for dt in ("f16", "bf16"):
        for n in (64, 128):
            for d in (64, 128, 256):
                for acc0 in (0, 1):  # scale-d of the first wgmma; Q slice 1 (rows 64..127) with it
                    cases.append(Case(f"qk_{dt}_n{n}_d{d}_acc{acc0}", "qk", f"probe_qk<{CTYPE[dt]}, {n}, {d}>",
                                      (("dtype", dt), ("N", n), ("D", d), ("scale_d_first", acc0),
                                       ("qslice", acc0))))
    for dt in ("f16", "bf16"):
        for d in (64, 128, 256):
            for bn in (64, 128):
                for acc0 in (0, 1):
                    cases.append(Case(f"pv_{dt}_d{d}_bn{bn}_acc{acc0}", "pv", f"probe_pv<{CTYPE[dt]}, {d}, {bn}>",
                                      (("dtype", dt), ("D", d), ("BLOCK_N", bn), ("scale_d_first", acc0))))
    # TMA: (swizzle, box[0] elements): rows as wide as the swizzle span, an 80-byte row without
    # swizzle, then rows narrower than the span (64 B under 128B, 32 B under 64B)
    for sw, b0, tag in (("none", 40, ""), ("32B", 16, ""), ("64B", 32, ""), ("128B", 64, ""),
                        ("128B", 32, "_narrow"), ("64B", 16, "_narrow")):
        for where in ("end", "start") if not tag else ("end",):
            cases.append(Case(f"tma_{sw}{tag}_{where}", "tma", "probe_tma_box",
                              (("swizzle", sw), ("box", (b0, 16, 2, 1)), ("where", where))))
    for dt, d, bn in (("f16", 64, 128), ("bf16", 128, 128), ("bf16", 256, 64)):
        cases.append(Case(f"attn_tma_{dt}_d{d}_bn{bn}", "attn_tma", f"probe_attn_tma<{CTYPE[dt]}, {d}, {bn}>",
                          (("dtype", dt), ("D", d), ("BLOCK_N", bn), ("qslice", 1))))
    return cases


CASES = _cases()
NAMES = sorted({c.kernel for c in CASES})

# ---------------------------------------------------------------------------------------------
# the ISA's layouts, as NumPy (written from the PTX ISA and the CUDA programming guide, not from
# the emulator's C++)


def swizzle_addr(addr, span: int):
    """The TMA / wgmma swizzle of a shared byte address: the 16-byte chunk index (bits 4..) XOR
    the 128-byte line index (bits 7..), mod 2, 4, 8 for the 32, 64, 128-byte modes."""
    addr = np.asarray(addr)
    return addr ^ (((addr >> 7) & (span // 16 - 1)) << 4) if span else addr


def place_tile(bits: np.ndarray) -> np.ndarray:
    """A (rows, cols) matrix of 16-bit elements as the kernel's tile: cols/64 column blocks of
    rows x 128 bytes, 128-byte swizzle, the tile at a 1024-byte boundary. Bytes, uint8."""
    rows, cols = bits.shape
    assert cols % 64 == 0 and rows % 8 == 0
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = (c // 64) * rows * 128 + r * 128 + (c % 64) * 2
    img = np.zeros(rows * cols, np.uint16)
    img[swizzle_addr(off, 128) // 2] = bits
    return img.view(np.uint8)


def d_pos(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col), each (128, n/2): accumulator d[4j + i] of warpgroup thread t holds row
    16w + g + 8 (i >= 2), col 8j + 2q + (i & 1) (w = t/32, g = lane/4, q = lane%4)."""
    t = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    w, g, q = t // 32, (t % 32) // 4, t % 4
    row = 16 * w + g + 8 * ((i % 4) >> 1)
    col = 8 * (i // 4) + 2 * q + (i & 1)
    return np.broadcast_to(row, (128, n // 2)), np.broadcast_to(col, (128, n // 2))


def a_pos() -> tuple[np.ndarray, np.ndarray]:
    """(row, col), each (128, 4, 2): A register a[r] of thread t holds, in its half h (low
    first), row 16w + g + 8 (r & 1), col 2q + h + 8 (r >= 2) of the 64 x 16 A tile."""
    t = np.arange(128)[:, None, None]
    r = np.arange(4)[None, :, None]
    h = np.arange(2)[None, None, :]
    w, g, q = t // 32, (t % 32) // 4, t % 4
    row = 16 * w + g + 8 * (r & 1)
    col = 2 * q + h + 8 * (r >> 1)
    return np.broadcast_to(row, (128, 4, 2)), np.broadcast_to(col, (128, 4, 2))


def to_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Exactly representable values as f16 / bf16 bit patterns (uint16)."""
    x = np.asarray(x, np.float64)
    if dtype == "f16":
        h = x.astype(np.float16)
        assert (h.astype(np.float64) == x).all(), "not exact in f16"
        return h.view(np.uint16)
    u = x.astype(np.float32).view(np.uint32)
    assert (u & 0xFFFF == 0).all() and (u.view(np.float32) == x).all(), "not exact in bf16"
    return (u >> 16).astype(np.uint16)


def a_regs(P: np.ndarray, dtype: str) -> np.ndarray:
    """The rs-form A fragments of P (64 x K): (128 threads, K/16 k16 steps, 4) uint32."""
    bits = to_bits(P, dtype).astype(np.uint32)
    row, col = a_pos()
    steps = P.shape[1] // 16
    out = np.empty((128, steps, 4), np.uint32)
    for kc in range(steps):
        v = bits[row, 16 * kc + col]  # (128, 4, 2)
        out[:, kc] = v[..., 0] | (v[..., 1] << 16)
    return out


def regs_of(M: np.ndarray) -> np.ndarray:
    """The accumulator registers (128, n/2) float32 of a 64 x n fp32 matrix."""
    row, col = d_pos(M.shape[1])
    return M[row, col].astype(np.float32)


def small_ints(rng, shape, bound: int = 4) -> np.ndarray:
    """Nonzero integers in [-bound, bound] (no zero factor, so no -0 anywhere), float64."""
    x = rng.integers(1, bound + 1, shape) * rng.choice([-1, 1], shape)
    return x.astype(np.float64)


# ---------------------------------------------------------------------------------------------
# inputs and the model of each probe

TMA_DIMS = (100, 20, 3, 2)  # (D, S, H, B) of the TMA tensor; rows padded to 104 elements
TMA_DST = 1024              # the box's shared offset in probe_tma_box (1024-byte aligned)
TMA_PAD = 0xFFFF            # the padding columns 100..103: never read by a correct copy
SPANS = {"none": 0, "32B": 32, "64B": 64, "128B": 128}


def tma_tensor() -> tuple[np.ndarray, np.ndarray]:
    """(x, L): x (B, S, H, 104) uint16 in memory, element (d, s, h, b) = 1 + d + 100 (s + 20 (h + 3 b))
    for d < 100 (every element names itself), padding TMA_PAD; L the view indexed [d, s, h, b]."""
    D, S, H, B = TMA_DIMS
    d, s, h, b = np.meshgrid(*(np.arange(n) for n in TMA_DIMS), indexing="ij")
    L = (1 + d + D * (s + S * (h + H * b))).astype(np.uint16)
    x = np.full((B, S, H, 104), TMA_PAD, np.uint16)
    x[..., :D] = L.transpose(3, 1, 2, 0)
    return x, L


def tma_element(v: int) -> str:
    if v == 0:
        return "zero (out-of-bound fill)"
    if v == 0xA5A5:
        return "untouched (the 0xA5 pre-fill)"
    if v == TMA_PAD:
        return "a padding column past dims[0] (read from memory outside the tensor)"
    D, S, H, _ = TMA_DIMS
    if v > D * S * H * 2:
        return "no element of the tensor"
    i = v - 1
    return f"element (d {i % D}, s {i // D % S}, h {i // (D * S) % H}, b {i // (D * S * H)})"


def tma_coords(case: Case) -> tuple[int, int, int, int]:
    b0 = case.p["box"][0]
    if case.p["where"] == "start":
        return (-8, -5, -1, 0)               # before the start in dims 0, 1 and 2
    c0 = (TMA_DIMS[0] - b0 // 2) // 8 * 8    # half the row past dims[0] (16-byte aligned start)
    return (c0, 12, 1, 1)                    # rows 12..27 of 20: past the end in dims 0 and 1


def tma_bytes(case: Case) -> tuple[int, int]:
    """(box bytes, bytes read back): the box plus as much again (a box that wrote padded rows,
    or past its span, shows there) plus 256."""
    box_bytes = 2 * int(np.prod(case.p["box"]))
    return box_bytes, 2 * box_bytes + 256


def tma_model(case: Case) -> dict:
    _, L = tma_tensor()
    box, span = case.p["box"], SPANS[case.p["swizzle"]]
    raw = box_values(L, box, tma_coords(case)).reshape(-1).view(np.uint8)
    box_bytes, out_bytes = tma_bytes(case)
    img = np.full(out_bytes, 0xA5, np.uint8)
    chunks = np.arange(0, box_bytes, 16)
    row_bytes = 2 * box[0]
    pitch = max(row_bytes, span) if span else row_bytes  # a row narrower than the span takes a span
    at = chunks // row_bytes * pitch + chunks % row_bytes
    dest = swizzle_addr(TMA_DST + at, span) - TMA_DST  # the swizzle acts on the address
    for o, p in zip(chunks, dest):
        img[p:p + 16] = raw[o:o + 16]
    return {"status": np.zeros(1, np.int32), "smem": img}


def rng_of(case: Case):
    return np.random.default_rng(zlib.crc32(case.name.encode()))


def qk_inputs(case: Case) -> dict:
    p, rng = case.p, rng_of(case)
    n, d = p["N"], p["D"]
    if case.kind == "frag_d":  # S[m][n] = 256 m + n + 1 through k = 0, 1
        Q = np.zeros((128, d))
        K = np.zeros((n, d))
        Q[:64, 0], Q[:64, 1] = np.arange(64), 1
        K[:, 0], K[:, 1] = 256, np.arange(n) + 1
        init = np.zeros((128, n // 2))
    else:
        Q, K = small_ints(rng, (128, d)), small_ints(rng, (n, d))
        init = small_ints(rng, (128, n // 2), 8)
    return {"Q": Q, "K": K, "init": init.astype(np.float32)}


def pv_inputs(case: Case) -> dict:
    p, rng = case.p, rng_of(case)
    d, bn = p["D"], p["BLOCK_N"]
    if case.kind == "frag_a":  # O[m][d] = P[m][d % 16] = 16 m + d % 16 + 1 through keys 0..15
        P = np.zeros((64, bn))
        P[:, :16] = 16 * np.arange(64)[:, None] + np.arange(16)[None, :] + 1
        V = np.zeros((bn, d))
        V[np.arange(d) % 16, np.arange(d)] = 1
        init = np.zeros((128, d // 2))
    else:
        P, V = small_ints(rng, (64, bn)), small_ints(rng, (bn, d))
        init = small_ints(rng, (128, d // 2), 8)
    return {"P": P, "V": V, "init": init.astype(np.float32)}


ATTN = {"B": 1, "H": 2, "Hkv": 1, "Sq": 200, "Sk": 300, "q_start": 30, "q_len": 100, "k_start": 7,
        "h": 1, "hk": 0, "b": 0}


def attn_inputs(case: Case) -> dict:
    """Q (1, 200, 2, D), K, V (1, 300, 1, D) as the kernel sees them: maps of q rows [30, 130) and
    k rows [7, 7 + BLOCK_N + 20); the probe loads query tile 0 (rows 100..127 of it past q_len:
    zeros) and key tile 1 (keys 20.. of it past k_len: zeros)."""
    p, rng, a = case.p, rng_of(case), ATTN
    d, bn = p["D"], p["BLOCK_N"]
    q = rng.choice([-1.0, 1.0], (a["B"], a["Sq"], a["H"], d))  # |S| <= D: exact in f16 and bf16
    k = rng.choice([-1.0, 1.0], (a["B"], a["Sk"], a["Hkv"], d))
    v = small_ints(rng, (a["B"], a["Sk"], a["Hkv"], d))
    o_init = small_ints(rng, (128, d // 2), 8).astype(np.float32)
    return {"q": q, "k": k, "v": v, "o_init": o_init, "k_len": bn + 20}


def attn_tiles(case: Case, inp: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiles the probe's TMA should bring: Q (128 x D) from q row q_start, K and V (BLOCK_N x
    D) from k row k_start + BLOCK_N, zeros past q_len / k_len."""
    a, bn = ATTN, case.p["BLOCK_N"]
    Qt = np.zeros((128, case.p["D"]))
    Qt[:a["q_len"]] = inp["q"][a["b"], a["q_start"]:a["q_start"] + a["q_len"], a["h"]][:128]
    Kt, Vt = np.zeros((bn, case.p["D"])), np.zeros((bn, case.p["D"]))
    k0, valid = a["k_start"] + bn, inp["k_len"] - bn
    Kt[:valid] = inp["k"][a["b"], k0:k0 + valid, a["hk"]]
    Vt[:valid] = inp["v"][a["b"], k0:k0 + valid, a["hk"]]
    return Qt, Kt, Vt


def model(case: Case) -> dict:
    """The outputs the ISA fixes, raw: uint8 bytes (TMA) or uint32 register bits."""
    if case.kind == "tma":
        return tma_model(case)
    if case.kind in ("qk", "frag_d"):
        inp, p = qk_inputs(case), case.p
        s0 = 64 * p["qslice"]
        S = inp["Q"][s0:s0 + 64] @ inp["K"].T
        regs = regs_of(S) + (inp["init"] if p["scale_d_first"] else 0)
        return {"d": regs.astype(np.float32).view(np.uint32)}
    if case.kind in ("pv", "frag_a"):
        inp = pv_inputs(case)
        regs = regs_of(inp["P"] @ inp["V"]) + (inp["init"] if case.p["scale_d_first"] else 0)
        return {"d": regs.astype(np.float32).view(np.uint32)}
    inp = attn_inputs(case)
    Qt, Kt, Vt = attn_tiles(case, inp)
    S = Qt[64 * case.p["qslice"]:][:64] @ Kt.T
    O = regs_of(S @ Vt) + inp["o_init"]
    return {"status": np.zeros(1, np.int32), "s": regs_of(S).view(np.uint32),
            "o": O.astype(np.float32).view(np.uint32)}


# ---------------------------------------------------------------------------------------------
# running a probe (the same code for both backends)

TMAP = np.dtype([("opaque", np.uint8, (128,))])  # a TensorMap passed by value


class Emulator:
    name = "emulated"

    def __init__(self):
        from burstcu.build.emulate import build_module
        self.mod = build_module([PROBES], NAMES)

    def put(self, x):
        return np.ascontiguousarray(x)

    def get(self, x):
        return np.asarray(x)

    def ptr(self, x) -> int:
        return int(x.ctypes.data)

    def launch(self, kernel: str, args: tuple, smem: int) -> None:
        self.mod.get_function(kernel)((1,), (128,), args, shared_mem=smem)


class Gpu:
    name = "cupy"

    def __init__(self):
        import cupy

        from burstcu.build.compile import cached_cubin, source_digest
        self.cp = cupy
        # the CUBIN cache key hashes the probe file; hopper.cuh and what it includes live in
        # kernels/, so their digest goes into the options (a define nobody reads)
        deps = source_digest("hopper.cuh", kernel_dir())[:16]
        path, self.lowered = cached_cubin(PROBES.name, NAMES, "sm_90a",
                                          (f"-I{kernel_dir()}", f"-DBURSTCU_PROBE_DEPS=0x{deps}"), kdir=HERE)
        self.log = json.loads(path.with_suffix(".json").read_text()).get("log", "")
        self.mod = cupy.RawModule(path=str(path))
        self.fns: dict = {}

    def put(self, x):
        return self.cp.asarray(np.ascontiguousarray(x))

    def get(self, x):
        return self.cp.asnumpy(x)

    def ptr(self, x) -> int:
        return int(x.data.ptr)

    def launch(self, kernel: str, args: tuple, smem: int) -> None:
        fn = self.fns.get(kernel)
        if fn is None:
            fn = self.fns[kernel] = self.mod.get_function(self.lowered[kernel])
        if smem > 48 * 1024:
            fn.max_dynamic_shared_size_bytes = smem
        fn((1,), (128,), args, shared_mem=smem)
        self.cp.cuda.runtime.deviceSynchronize()


def tmap(be, x, *args) -> np.void:
    return np.frombuffer(tensor_map(be.name, be.ptr(x), *args).tobytes(), TMAP)[0]


def sentinel(shape) -> np.ndarray:
    return np.full(shape, SENTINEL, np.uint32)


def run(case: Case, be) -> dict:
    """Run one probe on backend `be`; its raw outputs as NumPy (the model's keys)."""
    p = case.p
    if case.kind == "tma":
        x, _ = tma_tensor()
        box_bytes, out_bytes = tma_bytes(case)
        xd = be.put(x)
        D, S, H, B = TMA_DIMS
        m = tmap(be, xd, "float16", TMA_DIMS, (H * 104 * 2, 104 * 2, S * H * 104 * 2), p["box"], p["swizzle"])
        out, status = be.put(np.zeros(out_bytes, np.uint8)), be.put(np.zeros(1, np.int32))
        be.launch(case.kernel, (m, *map(i32, tma_coords(case)), i32(box_bytes), i32(out_bytes), out, status),
                  2048 + out_bytes)
        return {"status": be.get(status), "smem": be.get(out)}
    if case.kind in ("qk", "frag_d"):
        inp, dt, n, d = qk_inputs(case), p["dtype"], p["N"], p["D"]
        q_img = be.put(place_tile(to_bits(inp["Q"], dt)))
        k_img = be.put(place_tile(to_bits(inp["K"], dt)))
        init, out = be.put(inp["init"]), be.put(sentinel((128, n // 2)))
        be.launch(case.kernel, (q_img, k_img, i32(p["qslice"]), i32(p["scale_d_first"]), init, out),
                  1024 + (128 + n) * d * 2)
        return {"d": be.get(out)}
    if case.kind in ("pv", "frag_a"):
        inp, dt, d, bn = pv_inputs(case), p["dtype"], p["D"], p["BLOCK_N"]
        v_img = be.put(place_tile(to_bits(inp["V"], dt)))
        regs = be.put(a_regs(inp["P"], dt))
        init, out = be.put(inp["init"]), be.put(sentinel((128, d // 2)))
        be.launch(case.kernel, (v_img, regs, i32(p["scale_d_first"]), init, out), 1024 + bn * d * 2)
        return {"d": be.get(out)}
    inp, a, dt, d, bn = attn_inputs(case), ATTN, p["dtype"], p["D"], p["BLOCK_N"]
    q, k, v = (be.put(to_bits(inp[n], dt).view(np.float16)) for n in ("q", "k", "v"))
    qm = rows_map(be, q, dt, a["q_start"], a["q_len"], 128)
    km = rows_map(be, k, dt, a["k_start"], inp["k_len"], bn)
    vm = rows_map(be, v, dt, a["k_start"], inp["k_len"], bn)
    o_init = be.put(inp["o_init"])
    s_out, o_out = be.put(sentinel((128, bn // 2))), be.put(sentinel((128, d // 2)))
    status = be.put(np.zeros(1, np.int32))
    be.launch(case.kernel, (qm, km, vm, i32(0), i32(bn), i32(a["h"]), i32(a["hk"]), i32(a["b"]),
                            i32(p["qslice"]), o_init, s_out, o_out, status),
              2048 + (128 + 2 * bn) * d * 2)
    return {"status": be.get(status), "s": be.get(s_out), "o": be.get(o_out)}


def rows_map(be, x16, dtype: str, row_start: int, row_count: int, box_rows: int) -> np.void:
    """The kernel's map of rows [row_start, row_start + row_count) of a contiguous (B, S, H, D)
    array of 16-bit patterns (held as float16): tensor_map_4d_rows itself for f16; for bf16 (which
    CuPy arrays cannot hold) the same dims, strides and box with the bfloat16 data type."""
    if dtype == "f16":
        m = tensor_map_4d_rows(be.name, x16, row_start, row_count, box_rows)
    else:
        B, S, H, D = x16.shape
        m = tensor_map(be.name, be.ptr(x16) + row_start * H * D * 2, "bfloat16", (D, row_count, H, B),
                       (H * D * 2, D * 2, S * H * D * 2), (64, box_rows, 1, 1), "128B")
    return np.frombuffer(m.tobytes(), TMAP)[0]


# ---------------------------------------------------------------------------------------------
# comparing raw outputs, and saying what a wrong value is


def fnum(bits) -> float | str:
    """A float32 bit pattern as a JSON number, or a string for Inf / NaN (with its bits)."""
    x = float(np.uint32(bits).view(np.float32))
    return x if np.isfinite(x) else f"{x} (0x{int(bits):08x})"


@functools.lru_cache(maxsize=None)
def a_owner() -> dict:
    """(row, col) of the 64 x 16 A tile -> (thread, register, half) holding it (`a_pos`)."""
    row, col = a_pos()
    return {(int(row[t, r, h]), int(col[t, r, h])): (t, r, h) for t in range(128) for r in range(4) for h in range(2)}


def explain_register(case: Case, row: int, col: int, got: float | str) -> str | None:
    """For the fragment probes: which element the value in a register names."""
    if case.kind not in ("frag_d", "frag_a"):
        return None
    v = got if isinstance(got, float) else float("nan")
    named = np.isfinite(v) and v == int(v)
    if case.kind == "frag_d":
        if not named or not 1 <= v <= 256 * 64:
            return "holds no S element (S[m][n] = 256 m + n + 1)"
        m, n = divmod(int(v) - 1, 256)
        return f"holds S(row {m}, col {n}), wanted S(row {row}, col {col})"
    want = a_owner()[(row, col % 16)]
    if not named or not 1 <= v <= 16 * 64:
        return f"holds no A element (A[m][k] = 16 m + k + 1); wanted A(row {row}, col {col % 16}), which the " \
               f"host put in thread {want[0]} a[{want[1]}] half {want[2]}"
    m, k = divmod(int(v) - 1, 16)
    have = a_owner()[(m, k)]
    return (f"holds A(row {m}, col {k}), which the host put in thread {have[0]} a[{have[1]}] half {have[2]}; wanted "
            f"A(row {row}, col {col % 16}), which the host put in thread {want[0]} a[{want[1]}] half {want[2]}")


def compare(case: Case, got: dict, want: dict) -> dict:
    """Bitwise comparison of every output of `want`: {"equal", "compared" (values: registers,
    16-bit shared elements), "mismatches", "first": up to FIRST mismatches (for shared bytes, the
    first wrong element of each wrong 16-byte chunk), each saying where (thread, register, row,
    col; or byte offset from the box) and what (got, want, and for TMA bytes and the fragment
    probes which element each value names)}."""
    res = {"equal": True, "compared": 0, "mismatches": 0, "by_output": {}, "first": []}
    for key, w in want.items():
        g = np.asarray(got[key])
        if key == "smem":  # compare 16-bit elements: each names the tensor element it came from
            g, w = g.view(np.uint16), np.asarray(w).view(np.uint16)
        bad = np.argwhere(g != w)
        res["compared"] += int(w.size)
        res["mismatches"] += len(bad)
        res["by_output"][key] = len(bad)
        if key == "smem":  # list the first wrong element of each 16-byte chunk
            _, first = np.unique(bad[:, 0] // 8, return_index=True)
            bad = bad[np.sort(first)]
        for idx in bad[:max(0, FIRST - len(res["first"]))]:
            idx = tuple(int(i) for i in idx)
            gv, wv = g[idx], w[idx]
            if key == "smem":
                e = {"output": "smem", "offset": 2 * idx[0], "got": f"0x{int(gv):04x}", "want": f"0x{int(wv):04x}",
                     "got_is": tma_element(int(gv)), "want_is": tma_element(int(wv))}
            elif key == "status":
                e = {"output": "status", "got": int(gv), "want": int(wv),
                     "meaning": "a bounded mbarrier wait gave up: the copies credited fewer bytes than expected"}
            else:
                t, i = idx
                row, col = (int(a[t, i]) for a in d_pos(2 * g.shape[1]))
                e = {"output": key, "thread": t, "register": i, "row": row, "col": col, "got": fnum(gv),
                     "want": fnum(wv), "got_bits": f"0x{int(gv):08x}", "want_bits": f"0x{int(wv):08x}"}
                why = explain_register(case, row, col, e["got"])
                if why:
                    e["explain"] = why
            res["first"].append(e)
    res["equal"] = res["mismatches"] == 0
    return res


def summary(res: dict) -> str:
    if "error" in res:
        return res["error"]
    lines = [f"{res['mismatches']} of {res['compared']} values differ; the first:"]
    lines += [json.dumps(e) for e in res["first"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the report (BURSTCU_ISA_REPORT=path.json)

ASKS = {
    "frag_d": "the accumulator fragment table: which (row, col) of D each register d[i] of each thread holds "
              "(S[m][n] = 256 m + n + 1 names it; wgmma.ss m64n256k16 f16, operands as in qk)",
    "frag_a": "the A fragment table of the rs form: which (row, col) of A each half of a[0..3] of each thread is "
              "(O[m][d] = A[m][d % 16] = 16 m + d % 16 + 1 names it; wgmma.rs m64n64k16 f16, V as in pv)",
    "qk": "S = Q K^T as flash_fwd_sm90.cu issues it: K-major 128B-swizzled Q and K tiles [D/64][rows][64], "
          "SBO 1024, LBO 16, +32 B k16 steps within a 128-byte row, next column block at + rows x 128 B; "
          "scale-d of the first wgmma false (init discarded) or true (init + Q K^T)",
    "pv": "O += P V as flash_fwd_sm90.cu issues it: P from registers (A fragments), V N-major (imm-trans-b 1) "
          "128B-swizzled [D/64][BLOCK_N][64], LBO BLOCK_N x 128, SBO 1024, +2048 B k16 steps, N = D; "
          "scale-d of the first wgmma false or true",
    "tma": "where one cp.async.bulk.tensor.4d box lands in shared memory: element order (dim 0 innermost), "
           "zero fill outside the tensor (element-granular in dim 0), the swizzle of 16-byte chunks by the "
           "address bits (a row narrower than the span still starts a span of its own, the rest of it untouched), "
           "nothing written past "
           "the box, the whole box's bytes credited to the mbarrier",
    "attn_tma": "the kernel's data path: Q, K, V by TMA with tensor_map_4d_rows' maps (rows past q_len / k_len "
                "zero), S = Q K^T (ss), S packed into A fragments as pack_p does, O = init + P V (rs)",
}
RECORDS: dict[str, dict] = {
    c.name: {"name": c.name, "kind": c.kind, "asks": ASKS[c.kind], "kernel": c.kernel, "params": dict(c.params),
             "emulator_vs_model": None, "gpu_vs_model": None, "gpu_vs_emulator_bitwise": None}
    for c in CASES}
ENVIRONMENT: dict = {"backend": BACKEND}


def save() -> None:
    if not REPORT:
        return

    def count(key: str) -> dict:
        got = [r[key] for r in RECORDS.values() if isinstance(r[key], dict) and "equal" in r[key]]
        return {"run": len(got), "equal": sum(r["equal"] for r in got)}

    report = {
        "generated_by": "tests/gpu/test_hopper_isa_gpu.py (probes: tests/gpu/hopper_isa_probes.cu)",
        "legend": "per probe: emulator_vs_model, gpu_vs_model and gpu_vs_emulator_bitwise compare raw outputs bit "
                  "for bit (registers as float32 bits; shared memory as 16-bit elements), with the model resp. the "
                  "emulator as `want`; by_output counts the differing values of each output; `first` lists the "
                  "first few (thread, register, row, col, got, want) or (byte offset, got, want, which tensor "
                  "element each is); {skipped: why} / {error: message} when a side did not run",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": ENVIRONMENT,
        "summary": {"probes": len(RECORDS), "emulator_vs_model": count("emulator_vs_model"),
                    "gpu_vs_model": count("gpu_vs_model"),
                    "gpu_vs_emulator_bitwise": count("gpu_vs_emulator_bitwise")},
        "probes": list(RECORDS.values()),
    }
    path = Path(REPORT)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# the two backends


def started_once(what: str, start):
    """`start()`'s result, made once; if it raised, the same RuntimeError every time after
    (recorded in the report as ENVIRONMENT[f"{what}_error"], never retried)."""
    slot: list = []

    def get():
        if not slot:
            try:
                slot.append(start())
            except Exception as exc:
                slot.append(exc)
                ENVIRONMENT[f"{what}_error"] = f"{type(exc).__name__}: {exc}"
                save()
        if isinstance(slot[0], Exception):
            raise RuntimeError(f"the {what} side could not start: {slot[0]}") from slot[0]
        return slot[0]
    return get


emulator = started_once("emulator", lambda: Emulator())


@functools.lru_cache(maxsize=None)
def emulator_outputs(name: str) -> tuple[bool, dict | str]:
    """(True, outputs) or (False, why the emulator could not run the probe); once per probe."""
    case = next(c for c in CASES if c.name == name)
    try:
        return True, run(case, emulator())
    except Exception as exc:  # a build failure or an emulator report: recorded, not raised here
        return False, f"{type(exc).__name__}: {exc}"


@functools.lru_cache(maxsize=None)
def gpu_problem() -> str | None:
    """Why the GPU half cannot run here, or None."""
    if BACKEND != "cupy":
        return ("the GPU half runs with BURSTCU_KERNEL_TEST_BACKEND=cupy on a compute capability 9.0 GPU "
                f"(backend here: {BACKEND})")
    from burstcu.transport.bootstrap import gpu_usable
    if not gpu_usable():
        return "BURSTCU_KERNEL_TEST_BACKEND=cupy but CuPy sees no usable CUDA GPU"
    from burstcu.build.compile import compute_capability
    cc = compute_capability()
    if cc != 90:
        return (f"the probes are sm_90a code (wgmma, TMA): they run only on compute capability 9.0, this device "
                f"is {cc // 10}.{cc % 10}")
    return None


def _start_gpu() -> Gpu:
    import cupy
    from cuda.bindings import nvrtc

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    ENVIRONMENT.update({
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "driver_version": cupy.cuda.runtime.driverGetVersion(),
        "runtime_version": cupy.cuda.runtime.runtimeGetVersion(),
        "nvrtc_version": list(nvrtc.nvrtcVersion()[1:]),
        "cupy_version": cupy.__version__,
    })
    g = Gpu()
    ENVIRONMENT["nvrtc_log"] = g.log  # ptxas remarks (e.g. wgmma serialized), if any
    save()
    return g


gpu = started_once("gpu", _start_gpu)


# ---------------------------------------------------------------------------------------------
# the tests


def test_the_model_is_consistent():
    """The host's own layout functions agree with each other: the fragment tables cover each
    (row, col) exactly once, and a 128B-swizzled TMA box of (64, 8) lands as place_tile lays out
    an 8 x 64 tile (the wgmma operands' layout is the one TMA writes)."""
    for n in (64, 128, 256):
        row, col = d_pos(n)
        assert len({(int(r), int(c)) for r, c in zip(row.ravel(), col.ravel())}) == 64 * n
    assert len(a_owner()) == 64 * 16 and set(a_owner()) == {(r, c) for r in range(64) for c in range(16)}
    tile = np.arange(1, 8 * 64 + 1, dtype=np.uint16).reshape(8, 64)
    raw = box_values(tile.T, (64, 8), (0, 0)).reshape(-1).view(np.uint8)
    landed = np.zeros(1024, np.uint8)
    for o in range(0, 1024, 16):
        p = int(swizzle_addr(TMA_DST + o, 128)) - TMA_DST
        landed[p:p + 16] = raw[o:o + 16]
    np.testing.assert_array_equal(landed, place_tile(tile))


@pytest.mark.emulated
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_emulator_matches_the_model(case):
    ok, out = emulator_outputs(case.name)
    res = compare(case, out, model(case)) if ok else {"error": out}
    RECORDS[case.name]["emulator_vs_model"] = res
    save()
    assert res.get("equal"), f"{case.name}: emulator vs model: {summary(res)}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_matches_the_model_and_the_emulator(case):
    rec = RECORDS[case.name]
    problem = gpu_problem()
    if problem:
        rec["gpu_vs_model"] = rec["gpu_vs_emulator_bitwise"] = {"skipped": problem}
        save()
        pytest.skip(problem)
    try:
        out = run(case, gpu())
    except Exception as exc:
        rec["gpu_vs_model"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
        raise
    vs_model = compare(case, out, model(case))
    ok, emu = emulator_outputs(case.name)
    vs_emu = compare(case, out, emu) if ok else {"error": f"the emulator did not run this probe: {emu}"}
    rec["gpu_vs_model"], rec["gpu_vs_emulator_bitwise"] = vs_model, vs_emu
    save()
    assert vs_model["equal"], f"{case.name}: GPU vs model: {summary(vs_model)}"
    if ok:
        assert vs_emu["equal"], f"{case.name}: GPU vs emulator: {summary(vs_emu)}"
