"""The compile gate: every kernel variant compiles with NVRTC for sm_80, sm_86, sm_90 and (once the
tables have it) sm_90a, without spills; the Hopper families' SASS holds HGMMA and no local memory.

Runs ``python -m burstcu.build check --arch ARCHS --json FILE`` as a subprocess, as CI does
(one process pool, a process a core), and checks the records. Needs cuda-python and the pinned
NVRTC/runtime/nvdisasm wheels, not a GPU. The `gate` fixture runs it twice, and every test of
the records runs once a run:
- the default run (-m "not slow"): sm_80's float16 and float32 variants and sm_90a's own variants
  (every variant of the sm_90a table with a target of its own: each Hopper family, new ones
  included, in both dtypes, with its SASS check);
- the slow run: sm_80's bfloat16 variants (the float16 kernels' code with the other 16-bit type:
  their registers differ by one in 2 of 227 variants) and the sm_86 and sm_90 tables (the same
  kernels as sm_80's with other tile tables), about three quarters of the compiles.
Each variant compiles in 0.1-1.5 s; one compiled for sm_90a adds an nvdisasm run of about 0.25 s.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")
pytest.importorskip("cuda.pathfinder")

from burstcu.build import all_variants  # noqa: E402
from burstcu.build import compile  # noqa: E402
from burstcu.build.compile import ARCH_LIMITS, MAX_REGISTERS, parse_ptxas  # noqa: E402
from burstcu.build import variants  # noqa: E402

HOPPER = "sm_90a" in variants.ARCHS
NO_HOPPER = "burstcu.build.variants.ARCHS has no 'sm_90a' yet: no Hopper table to gate"
# (arch, the dtypes gated or None for all) of the default run: sm_80's float16 and float32
# variants, and sm_90a's own variants (the Hopper families) once the tables have it; the slow run
# gates sm_80's bfloat16 variants and the other two tables, sm_86's and sm_90's
DEFAULT_RUN = (("sm_80", ("float16", "float32")),) + ((("sm_90a", None),) if HOPPER else ())
SLOW_RUN = (("sm_80", ("bfloat16",)), ("sm_86", None), ("sm_90", None))
ARCHS = tuple(dict.fromkeys(arch for arch, _ in DEFAULT_RUN + SLOW_RUN))
SM86_SMEM_PER_BLOCK = 101376  # 99 KB opt-in: RTX 3090/4090/5090, A10, A40, L4, L40S
FIELDS = ("name", "family", "arch", "dtype", "headdim", "threads", "registers", "spill_stores",
          "spill_loads", "stack_bytes", "static_smem_bytes", "dynamic_smem_bytes", "smem_bytes",
          "local_bytes", "target", "compile_seconds", "error")
SASS_FIELDS = ("sass_hgmma", "sass_ldl", "sass_stl")  # in every record compiled for sm_90a
REPO = Path(__file__).resolve().parents[2]


def _run_id(run) -> str:
    return ",".join(arch + (f"-{'+'.join(dtypes)}" if dtypes else "") for arch, dtypes in run)


def _gated(run, arch: str, variant) -> bool:
    """Whether `run` gates `variant` of `arch`'s table."""
    return any(a == arch and (dtypes is None or variant.dtype in dtypes) for a, dtypes in run)


@pytest.fixture(scope="module", params=[pytest.param(DEFAULT_RUN, id=_run_id(DEFAULT_RUN)),
                                        pytest.param(SLOW_RUN, id=_run_id(SLOW_RUN),
                                                     marks=pytest.mark.slow)])
def gate(request, tmp_path_factory):
    """(run, archs, largest return code, records, stdout) of one run of the gate, a `check` per
    (arch, dtypes) of `run`: DEFAULT_RUN in the default run, SLOW_RUN (marked slow) in the other."""
    run, codes, records, logs = request.param, [], [], []
    for arch, dtypes in run:
        path = tmp_path_factory.mktemp("gate") / "gate.json"
        proc = subprocess.run([sys.executable, "-m", "burstcu.build", "check", "--arch", arch,
                               *(("--dtype", ",".join(dtypes)) if dtypes else ()), "--json", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=900)
        codes.append(proc.returncode)
        records += json.loads(path.read_text()) if path.exists() else []
        logs.append(proc.stdout + proc.stderr)
    return run, tuple(dict.fromkeys(a for a, _ in run)), max(codes), records, "\n".join(logs)


def test_the_two_runs_of_the_gate_cover_every_variant_once():
    """The default and the slow run of the gate take every variant of every table, each once."""
    assert set(ARCHS) == set(variants.ARCHS)
    for arch in ARCHS:
        for v in all_variants(arch):
            assert _gated(DEFAULT_RUN, arch, v) + _gated(SLOW_RUN, arch, v) == 1, (arch, v.name)


def test_gate_passes(gate):
    _, _, rc, records, log = gate
    assert rc == 0, log[-4000:]
    assert not [r for r in records if r["error"]], log[-4000:]


def test_the_older_command_name_runs_the_same_gate(tmp_path):
    """`python -m burstcu.kernels check` (the older name of `python -m burstcu.build check`) gates
    the Hopper variants the same way: each sm_90a row carries sass_hgmma > 0, local_bytes 0 and
    its registers."""
    path = tmp_path / "gate.json"
    md = tmp_path / "occupancy.md"
    proc = subprocess.run([sys.executable, "-m", "burstcu.kernels", "check", "--arch", "sm_90a",
                           "--family", "forward_sm90", "--dtype", "float16", "--json", str(path),
                           "--md", str(md)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = json.loads(path.read_text())
    assert len(records) == 3
    assert {(r["family"], r["dtype"]) for r in records} == {("forward_sm90", "float16")}
    for r in records:
        assert r["sass_hgmma"] > 0 and r["local_bytes"] == 0 and 0 < r["registers"] <= MAX_REGISTERS, r
        assert r["blocks_per_sm"] >= 1 and 0 < r["occupancy"] <= 1, r
    rows = [line for line in md.read_text().splitlines() if line.startswith("| sm_90a | H100 |")]
    assert len(rows) == 3 and all(f"`{r['name']}`" in md.read_text() for r in records)


def test_occupancy_by_the_cuda_rules():
    """Blocks per SM from a record's registers, threads and shared memory, worked by hand: 128
    registers x 256 threads = 32K a block of A100's 64K; 54 KB + 1 KB reserved fits twice in
    164 KB; so 2 blocks, 16 warps of 64 (registers bind first, smem ties)."""
    from burstcu.build.compile import occupancy

    occ = occupancy({"arch": "sm_80", "threads": 256, "registers": 128, "smem_bytes": 54 * 1024})
    assert occ["by_resource"] == {"regs": 2, "smem": 2, "threads": 8, "blocks": 32}
    assert (occ["blocks_per_sm"], occ["warps_per_sm"], occ["limited_by"]) == (2, 16, "regs")
    assert occ["occupancy"] == 0.25
    # 255 registers round up to 256 a thread: 8K a warp, 8 warps an SM, one 4-warp block on
    # sm_86's 100 KB when it takes 60 KB
    occ = occupancy({"arch": "sm_86", "threads": 128, "registers": 255, "smem_bytes": 60 * 1024})
    assert occ["by_resource"]["regs"] == 2 and occ["by_resource"]["smem"] == 1
    assert (occ["blocks_per_sm"], occ["limited_by"], occ["occupancy"]) == (1, "smem", 4 / 48)


def test_every_variant_compiled(gate):
    run, archs, _, records, _ = gate
    # the sm_90a table's variants without a target of their own are the sm_90 table's (compiled
    # for the device's own arch at run time): the sm_90 rows gate them
    expected = {(arch, v.name) for arch in archs for v in all_variants(arch)
                if (arch != "sm_90a" or v.target) and _gated(run, arch, v)}
    assert {(r["arch"], r["name"]) for r in records} == expected
    for arch in set(archs) - {"sm_90a"}:
        families = {r["family"] for r in records if r["arch"] == arch}
        assert {"forward", "forward_finalize", "nonfinite_flag"} <= families, arch
        careful = {f + "_careful" for f in ("forward", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq")}
        assert careful <= families, arch


def test_records_complete(gate):
    _, _, _, records, _ = gate
    for r in records:
        missing = [f for f in FIELDS if f not in r]
        missing += [f for f in SASS_FIELDS if r["target"] == "sm_90a" and f not in r]
        assert not missing, (r["name"], missing)
        # the CUBIN's frame record and ptxas' report agree (local_bytes also counts callees)
        assert r["local_bytes"] >= r["stack_bytes"], r["name"]


@pytest.mark.skipif(not HOPPER, reason=NO_HOPPER)
def test_hopper_families_run_on_wgmma_without_local_memory(gate):
    """Every sm_90a row of a Hopper family (name containing "sm90") has HGMMA in its SASS and no
    local memory: no frame, no LDL/STL (careful twins excepted from the latter, as for spills).
    In the default run: the slow one compiles no sm_90a."""
    _, archs, _, records, _ = gate
    if "sm_90a" not in archs:
        pytest.skip(f"this run of the gate compiles {', '.join(archs)}: the default run gates sm_90a")
    rows = [r for r in records if r["arch"] == "sm_90a" and "sm90" in r["family"]]
    assert rows, "no Hopper family in the sm_90a table"
    for r in rows:
        where = f"{r['name']}: {r['error']}"
        assert r["target"] == "sm_90a", where
        assert r["sass_hgmma"] > 0, where
        if not r["family"].endswith("_careful"):
            assert r["local_bytes"] == 0 and r["sass_ldl"] == 0 and r["sass_stl"] == 0, where


def test_no_spills_and_budgets(gate):
    """No spills on the finite-data path; the careful twins (run only where Inf/NaN meets a
    masked pair) may spill, but within the same register and smem budgets."""
    _, _, _, records, _ = gate
    for r in records:
        where = f"{r['arch']} {r['name']}"
        if not r["family"].endswith("_careful"):
            assert r["spill_stores"] == 0 and r["spill_loads"] == 0, where
        assert 0 < r["registers"] <= MAX_REGISTERS, where
        assert r["smem_bytes"] == r["static_smem_bytes"] + r["dynamic_smem_bytes"], where
        assert r["smem_bytes"] <= ARCH_LIMITS[r["arch"]]["smem_per_block"], where
        # registers of a full block must fit the SM, or the kernel cannot launch at all
        assert r["registers"] * r["threads"] <= ARCH_LIMITS[r["arch"]]["regs_per_sm"], where


def test_sm86_table_fits_99KB(gate):
    """Every variant of the "sm_86" table (cc 8.6/8.7/8.9/12.x) fits 101376 B a block: as
    declared (no compile, in both runs) and as compiled (static + dynamic smem, in the slow run,
    which compiles that table)."""
    assert ARCH_LIMITS["sm_86"]["smem_per_block"] == SM86_SMEM_PER_BLOCK
    for v in all_variants("sm_86"):
        assert v.launch.smem_bytes <= SM86_SMEM_PER_BLOCK, v.name
    _, archs, _, records, _ = gate
    sm86 = [r for r in records if r["arch"] == "sm_86"]
    assert len(sm86) == (len(all_variants("sm_86")) if "sm_86" in archs else 0)
    for r in sm86:
        assert r["smem_bytes"] <= SM86_SMEM_PER_BLOCK, (r["name"], r["smem_bytes"])


def test_forward_covers_native_headdims(gate):
    run, _, _, records, _ = gate
    for arch, dtypes in run:
        for dtype in dtypes or ("float16", "bfloat16"):
            if dtype == "float32":   # no forward step kernel of float32
                continue
            # sm_90a: its own rows are the Hopper family (64, 128, 256); the sm_90 rows gate the rest
            family = "forward_sm90" if arch == "sm_90a" else "forward"
            want = {64, 128, 256} if arch == "sm_90a" else {32, 64, 96, 128, 256}
            dims = {r["headdim"] for r in records if r["arch"] == arch and r["family"] == family
                    and r["dtype"] == dtype}
            assert dims == want, (arch, dtype, dims)


def test_parse_ptxas_report():
    """The parser on a report in ptxas' own words (two functions, one with static smem)."""
    log = """ptxas info    : 4 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function '_Z3barv' for 'sm_80'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 352 bytes cmem[0]
"""
    res = parse_ptxas(log)
    assert res["_Z3fooPf"].registers == 40
    assert (res["_Z3fooPf"].stack_bytes, res["_Z3fooPf"].spill_stores, res["_Z3fooPf"].spill_loads) == (16, 8, 4)
    assert res["_Z3fooPf"].static_smem_bytes == 2048
    assert res["_Z3barv"].registers == 8 and res["_Z3barv"].static_smem_bytes == 0


def test_gate_failure_reasons():
    """What makes a compiled record fail: spills, > 255 registers, smem over the arch's limit."""
    from burstcu.build.compile import gate_failure

    ok = {"arch": "sm_80", "family": "forward", "registers": 128, "spill_stores": 0, "spill_loads": 0,
          "smem_bytes": 1024}
    assert gate_failure(ok) is None
    assert "spills" in gate_failure({**ok, "spill_loads": 4})
    assert gate_failure({**ok, "family": "forward_careful", "spill_loads": 4}) is None
    assert "registers" in gate_failure({**ok, "family": "forward_careful", "registers": 256})
    assert "registers" in gate_failure({**ok, "registers": 256})
    assert "smem" in gate_failure({**ok, "smem_bytes": 200 * 1024})
    assert gate_failure({**ok, "arch": "sm_90", "smem_bytes": 200 * 1024}) is None


def test_kernels_too_big_for_a_gpu_are_refused_up_front():
    """A table that does not fit the GPU (here sm_80's on a 99 KB GPU: only if chosen by hand,
    `_device_table_arch` picks sm_86 there) gets a clear error at validation, per pass, instead of
    a failed launch mid-ring."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    ops = KernelOps("emulated")
    ops.smem_limit = 101376  # e.g. RTX 4090, L40S
    assert ops.headdim_problem(64) is None and ops.headdim_problem(64, backward=True) is None
    assert ops.headdim_problem(256) is None                       # the forward fits
    assert "shared memory" in ops.headdim_problem(256, backward=True)
    ops.deterministic = True
    assert "bwd_dq" in ops.headdim_problem(128, backward=True)


def test_sm86_table_runs_every_headdim_on_99KB():
    """The table those GPUs get: nothing refused, forward or backward, either mode."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    for deterministic in (False, True):
        ops = KernelOps("emulated", arch="sm_86", deterministic=deterministic)
        ops.smem_limit = SM86_SMEM_PER_BLOCK
        for d in (32, 40, 64, 96, 128, 200, 256):
            assert ops.headdim_problem(d) is None, d
            assert ops.headdim_problem(d, backward=True) is None, (d, deterministic)


@pytest.mark.parametrize("cc,table", [(80, "sm_80"), (86, "sm_86"), (87, "sm_86"), (89, "sm_86"),
                                      (90, "sm_90a"), (100, "sm_90"), (103, "sm_90"),
                                      (110, "sm_86"), (120, "sm_86"), (121, "sm_86")])
def test_device_table_arch(cc, table):
    from burstcu.ops.cuda.kernel_ops import table_arch_for

    assert table_arch_for(cc) == table


def test_device_table_arch_refuses_pre_ampere():
    from burstcu.ops.cuda.kernel_ops import table_arch_for

    with pytest.raises(RuntimeError, match="8.0"):
        table_arch_for(75)


def test_sizes_beyond_32bit_element_counts_are_accepted():
    """Forward and backward kernels take 64-bit strides: 2^31 elements and more are no problem."""
    import numpy as np

    from burstcu.ops.cuda.kernel_ops import KernelOps

    ops = KernelOps("emulated")
    small = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (1, 1024, 8, 64), (0, 0, 0, 0))
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (2, 2**20, 16, 64), (0, 0, 0, 0))
    assert ops.input_problem(small, small, backward=True) is None
    assert ops.input_problem(huge, huge) is None
    assert ops.input_problem(huge, huge, backward=True) is None


def test_an_unknown_family_is_refused_with_the_families(capsys):
    from burstcu.build.__main__ import main
    with pytest.raises(SystemExit) as stop:
        main(["check", "--family", "fwd"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown family ['fwd']" in err and "forward" in err and "nonfinite_flag" in err


def test_the_gate_finds_its_compiler_here():
    """Where cuda-python imports (this module's condition), `compiler_problem` lets the gate
    run; without it, tests/test_frictions.py checks the line that names the extra."""
    assert compile.compiler_problem() is None


def test_a_compiler_problem_ends_the_gate_with_one_line(monkeypatch, capsys):
    from burstcu.build import __main__ as gate
    monkeypatch.setattr(gate, "compiler_problem", lambda: "no NVRTC: pip install 'burstcu[cuda13]'")
    assert gate.main(["check", "--arch", "sm_80"]) == gate.NO_COMPILER != 0
    err = capsys.readouterr().err
    assert err == "python -m burstcu.build check: no NVRTC: pip install 'burstcu[cuda13]'\n"


# ------------------------------------------------------------------------------------------------
# sm_90a compiles, and the SASS reader (nvdisasm) on probe kernels

NEEDS_NVDISASM = pytest.mark.skipif(
    compile.find_nvdisasm() is None,
    reason=f"nvdisasm not found: pip install '{compile.NVDISASM_REQUIREMENT}' (the cuda13 extra)")

PROBES = r'''
#include "hopper.cuh"

// one wgmma m64n64k16 from shared memory (the contents do not matter: it is never launched)
extern "C" __global__ void probe_wgmma(float* out) {
  __shared__ __align__(128) __half a[64 * 16];
  __shared__ __align__(128) __half b[64 * 16];
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  wgmma_fence();
  wgmma_ss<__half, 64, 0, 0>(d, wgmma_desc(a, SWIZZLE_NONE, 128, 256), wgmma_desc(b, SWIZZLE_NONE, 128, 256), false);
  wgmma_commit();
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

// an array indexed at run time cannot live in registers: it is a local-memory frame
extern "C" __global__ void probe_local(float* out, const int* idx) {
  float buf[64];
#pragma unroll 1
  for (int i = 0; i < 64; ++i) buf[(i * 7 + threadIdx.x) & 63] = i * out[i];
  buf[idx[threadIdx.x] & 63] += 1.f;
  out[threadIdx.x] = buf[idx[threadIdx.x + 1] & 63];
}
'''


@pytest.fixture(scope="module")
def probe_cubin(tmp_path_factory):
    """The probes compiled by NVRTC for sm_90a (with the ptxas report)."""
    from burstcu.build.variants import kernel_dir

    folder = tmp_path_factory.mktemp("probes")
    (folder / "probes.cu").write_text(PROBES)
    return compile.nvrtc_compile("probes.cu", [], "sm_90a", extra_options=[f"-I{kernel_dir()}"],
                                  kdir=folder, ptxas_verbose=True)


def test_nvrtc_compiles_for_sm90a(probe_cubin):
    """--gpu-architecture=sm_90a: wgmma and the other arch-specific instructions assemble."""
    assert "for 'sm_90a'" in probe_cubin.log
    assert set(probe_cubin.resources) == {"probe_wgmma", "probe_local"}


@NEEDS_NVDISASM
def test_sass_of_a_wgmma_kernel_has_hgmma(probe_cubin):
    sass = compile.sass_summary(probe_cubin.cubin)
    assert set(sass) == {"probe_wgmma", "probe_local"}
    wg = sass["probe_wgmma"]
    assert wg.hgmma > 0 and wg.instructions > wg.hgmma
    assert (wg.ldl, wg.stl, wg.local_bytes) == (0, 0, 0)
    assert sass["probe_local"].hgmma == 0


@NEEDS_NVDISASM
def test_sass_of_a_local_array_has_ldl_stl(probe_cubin):
    local = compile.sass_summary(probe_cubin.cubin)["probe_local"]
    assert local.ldl > 0 and local.stl > 0
    assert local.local_bytes == 256 == probe_cubin.resources["probe_local"].stack_bytes  # 64 floats


def test_elf_frames_without_the_disassembler(probe_cubin):
    """local_bytes comes from the CUBIN's own records: no nvdisasm needed."""
    assert compile.elf_local_bytes(probe_cubin.cubin) == {"probe_wgmma": 0, "probe_local": 256}
    with pytest.raises(compile.SassError, match="not a CUBIN"):
        compile.elf_local_bytes(b"\x7fELF\x01" + bytes(100))


def test_parse_sass_listing():
    """Opcodes without modifiers, predicates skipped, per .text section, other sections ignored."""
    listing = """
	.section	.nv.info.k,"",@"SHT_CUDA_INFO"
        /*0000*/ 	.byte	0x04, 0x2f
	.section	.text.k,"ax",@progbits
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0020*/                   LDL.LU.64 R2, [R1+0x8] ;
        /*0030*/               @P1 STL.128 [R1], R4 ;
        /*0040*/             @!UP0 BRA `(.L_x_1) ;
	.section	.text.g,"ax",@progbits
        /*0000*/                   STL [R1], R7 ;
"""
    ops = compile.parse_sass(listing)
    assert ops == {"k": {"LDC": 1, "HGMMA": 1, "LDL": 1, "STL": 1, "BRA": 1}, "g": {"STL": 1}}


def test_a_missing_disassembler_fails_the_sm90a_rows_clearly(monkeypatch):
    """No nvdisasm: sass_summary says how to install it; the gate records the reason on every row
    compiled for sm_90a (a failure, not a crash) and leaves the other archs alone."""
    monkeypatch.setattr(compile, "find_nvdisasm", lambda: None)
    with pytest.raises(compile.DisassemblerMissing, match="pip install 'nvidia-cuda-nvdisasm"):
        compile.sass_summary(b"")
    variant = next(v for v in all_variants("sm_90") if v.family == "nonfinite_flag")
    record = compile.gate_variant(variant, "sm_90a")
    assert record["target"] == "sm_90a" and record["sass_hgmma"] is None
    assert "nvdisasm not found" in record["error"] and "sm_90a" in record["error"]
    assert compile.gate_variant(variant, "sm_90")["error"] is None


def test_gate_failure_hopper_rules():
    """A Hopper family compiled for sm_90a fails without HGMMA or with local memory (its careful
    twin may use local memory, as careful variants may spill); other families are not judged by
    their SASS."""
    from burstcu.build.compile import gate_failure

    ok = {"arch": "sm_90a", "target": "sm_90a", "family": "forward_sm90", "registers": 168,
          "threads": 384, "spill_stores": 0, "spill_loads": 0, "smem_bytes": 1024, "local_bytes": 0,
          "sass_hgmma": 24, "sass_ldl": 0, "sass_stl": 0}
    assert gate_failure(ok) is None
    # setmaxnreg's split needs the whole register file at launch: 65536 / 384 -> 168
    assert "register file" in gate_failure({**ok, "registers": 160})
    # ptxas reports a serialized wgmma as info, not as a warning: the record keeps it all the same
    serialized = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions "
                  "are serialized due to insufficient register resources for the function '_Z1k'")
    log = f"{serialized}\nptxas info    : Used 168 registers, used 3 barriers\n"
    assert compile.ptxas_concerns(log) == [serialized]
    assert "wgmma" in gate_failure({**ok, "ptxas_warnings": compile.ptxas_concerns(log)})
    assert "HGMMA" in gate_failure({**ok, "sass_hgmma": 0})
    assert "HGMMA" in gate_failure({**ok, "family": "forward_sm90_careful", "sass_hgmma": 0})
    assert "local memory" in gate_failure({**ok, "local_bytes": 16})
    assert "local memory" in gate_failure({**ok, "sass_stl": 1})
    assert gate_failure({**ok, "family": "forward_sm90_careful", "local_bytes": 16, "sass_ldl": 2}) is None
    assert gate_failure({**ok, "family": "forward", "sass_hgmma": 0}) is None
    assert "nvdisasm" in gate_failure({**ok, "sass_error": "nvdisasm not found", "sass_hgmma": None})


@pytest.mark.parametrize("target,cc,ok", [("sm_90a", 90, True), ("sm_90a", 100, False),
                                          ("sm_90a", 80, False), ("sm_90", 120, True),
                                          ("sm_90", 86, False), ("sm_100a", 100, True)])
def test_arch_specific_targets_run_on_their_own_cc_only(target, cc, ok):
    assert (compile.target_problem(target, cc) is None) == ok


def test_get_function_refuses_sm90a_off_hopper(monkeypatch):
    """Before any compile or CUDA call, with the device's compute capability in the message."""
    pytest.importorskip("cupy")
    monkeypatch.setattr(compile, "compute_capability", lambda device_id=None: 120)
    with pytest.raises(RuntimeError, match=r"sm_90a kernels run only on compute capability 9\.0 .*12\.0"):
        compile.get_function("flash_fwd_sm90.cu", "k", device_id=0, target="sm_90a")


def _sass_listing(source: str, name: str) -> list[str]:
    """The instructions (opcode and operands) of kernel `name` of kernels/`source` compiled for
    sm_90a, in program order (nvdisasm)."""
    compiled = compile.nvrtc_compile(source, [name], "sm_90a")
    tool = compile.find_nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not found (the cuda13 extra installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.cubin)
        text = compile.run_bounded([tool, "--print-code", "--no-dataflow", str(path)]).stdout
    return [line.split("*/", 1)[1].strip(" ;{}") for line in text.splitlines()
            if compile._INSTR_RE.match(line)]


# Hopper dK/dV variants and what their consumer loop does early (flash_bwd_sm90.cu's kDvEarly,
# kDqUnderDk): dV's products before the wait for dP^T; the dQ block's under dK's
SCHEDULES = [("flash_bwd_dkdv_sm90<__half, 128, 64, 2, 0>", True, False),
             ("flash_bwd_dkdv_sm90<__half, 128, 64, 2, 1>", True, True),
             ("flash_bwd_dkdv_sm90<__half, 128, 64, 2, 2>", True, True),
             ("flash_bwd_dkdv_steps_sm90<__nv_bfloat16, 128, 64, 2, 1>", True, True),
             ("flash_bwd_dkdv_sm90<__half, 64, 128, 2, 1>", False, True),
             ("flash_bwd_dkdv_sm90<__half, 256, 64, 2, 0>", True, False),
             ("flash_bwd_dkdv_sm90<__half, 256, 64, 2, 1>", True, False),
             ("flash_bwd_dkdv_steps_sm90<__half, 256, 64, 2, 1>", False, False)]


@pytest.mark.skipif(not HOPPER, reason=NO_HOPPER)
@pytest.mark.parametrize("name,dv_early,dq_under_dk", SCHEDULES)
def test_hopper_backward_keeps_its_tensor_cores_fed_within_a_tile(name, dv_early, dq_under_dk):
    """The Hopper dK/dV kernels (flash_bwd_sm90.cu's PIPELINE), read in their SASS: no wgmma
    serialized (far fewer WARPGROUP.DEPBAR than HGMMA); where dV goes early, every exp2 of P^T
    precedes dV's products (the first HGMMA with an A operand in registers), and the only wait
    between S^T's first product and dV's is the one for S^T (0x1), the next one after dV's the
    one for dP^T (0x1, before the dS tile's barriers); where the dQ block runs under dK, its
    products are issued before the consumers' arrival on the stage's empty barrier, and the
    wait just before that arrival leaves one group (dQ) in flight."""
    sass = _sass_listing("flash_bwd_sm90.cu", name)
    count = lambda op: sum(op in s for s in sass)  # noqa: E731
    assert 3 * count("WARPGROUP.DEPBAR") < count("HGMMA"), (count("WARPGROUP.DEPBAR"), count("HGMMA"))
    at = lambda pred, start=0: next(i for i in range(start, len(sass)) if pred(sass[i]))  # noqa: E731
    a_in_registers = lambda s: re.search(r"HGMMA\.\S+ R\d+, R\d+,", s) is not None  # noqa: E731
    dv = at(a_in_registers)
    if dv_early:
        exps = [i for i, s in enumerate(sass) if "MUFU.EX2" in s]
        assert exps and max(exps) < dv, (len(exps), exps[-1], dv)
        waits_before_dv = [s for s in sass[at(lambda s: "HGMMA" in s):dv] if "WARPGROUP.DEPBAR" in s]
        assert waits_before_dv == ["WARPGROUP.DEPBAR.LE gsb0, 0x1"], waits_before_dv
        dp_wait = at(lambda s: "WARPGROUP.DEPBAR" in s, dv)
        assert sass[dp_wait] == "WARPGROUP.DEPBAR.LE gsb0, 0x1" and not any(
            "BAR.SYNC" in s for s in sass[dv:dp_wait]), sass[dv:dp_wait + 1]
    if dq_under_dk:
        dk = at(a_in_registers, at(lambda s: "BAR.SYNC" in s, dv))   # after the dS tile's barriers
        dq_product = at(lambda s: re.search(r"HGMMA\.\S+ R\d+, gdesc", s) is not None, dk)
        arrival = at(lambda s: re.search(r"(^|\s)SYNCS\.ARRIVE", s) is not None, dk)
        last_wait = max(i for i in range(dk, arrival) if "WARPGROUP.DEPBAR" in sass[i])
        assert dq_product < arrival and sass[last_wait].endswith("0x1"), (dk, dq_product, arrival,
                                                                          sass[last_wait])
