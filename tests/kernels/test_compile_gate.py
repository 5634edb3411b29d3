"""The compile gate: every kernel variant compiles with NVRTC for sm_80, sm_86 and sm_90, without
spills.

Runs ``python -m burstcu.kernels check --arch sm_80,sm_86,sm_90 --json FILE`` as a subprocess, as
CI does, and checks the records. Needs cuda-python and the pinned NVRTC/runtime wheels, not a GPU.
About 1.5 minutes on two cores (each variant compiles in 0.1-1.5 s; one process a core).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")
pytest.importorskip("cuda.pathfinder")

from burstcu.kernels.compile import ARCH_LIMITS, MAX_REGISTERS, parse_ptxas  # noqa: E402
from burstcu.kernels import all_variants  # noqa: E402

ARCHS = ("sm_80", "sm_86", "sm_90")
SM86_SMEM_PER_BLOCK = 101376  # 99 KB opt-in: RTX 3090/4090/5090, A10, A40, L4, L40S
FIELDS = ("name", "family", "arch", "dtype", "headdim", "threads", "registers", "spill_stores",
          "spill_loads", "stack_bytes", "static_smem_bytes", "dynamic_smem_bytes", "smem_bytes",
          "compile_seconds", "error")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """(return code, records, stdout) of one run of the gate over every arch."""
    path = tmp_path_factory.mktemp("gate") / "gate.json"
    proc = subprocess.run([sys.executable, "-m", "burstcu.kernels", "check", "--arch", ",".join(ARCHS),
                           "--json", str(path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    records = json.loads(path.read_text()) if path.exists() else []
    return proc.returncode, records, proc.stdout + proc.stderr


def test_gate_passes(gate):
    rc, records, log = gate
    assert rc == 0, log[-4000:]
    assert not [r for r in records if r["error"]], log[-4000:]


def test_every_variant_compiled(gate):
    _, records, _ = gate
    expected = {(arch, v.name) for arch in ARCHS for v in all_variants(arch)}
    assert {(r["arch"], r["name"]) for r in records} == expected
    families = {r["family"] for r in records}
    assert {"forward", "forward_finalize", "nonfinite_flag"} <= families
    assert {f + "_careful" for f in ("forward", "bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq")} <= families


def test_records_complete(gate):
    _, records, _ = gate
    for r in records:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, (r["name"], missing)


def test_no_spills_and_budgets(gate):
    """No spills on the finite-data path; the careful twins (run only where Inf/NaN meets a
    masked pair) may spill, but within the same register and smem budgets."""
    _, records, _ = gate
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
    declared (no compile) and as compiled (static + dynamic smem)."""
    assert ARCH_LIMITS["sm_86"]["smem_per_block"] == SM86_SMEM_PER_BLOCK
    for v in all_variants("sm_86"):
        assert v.launch.smem_bytes <= SM86_SMEM_PER_BLOCK, v.name
    _, records, _ = gate
    sm86 = [r for r in records if r["arch"] == "sm_86"]
    assert len(sm86) == len(all_variants("sm_86"))
    for r in sm86:
        assert r["smem_bytes"] <= SM86_SMEM_PER_BLOCK, (r["name"], r["smem_bytes"])


def test_forward_covers_native_headdims(gate):
    _, records, _ = gate
    for arch in ARCHS:
        for dtype in ("float16", "bfloat16"):
            dims = {r["headdim"] for r in records if r["arch"] == arch and r["family"] == "forward"
                    and r["dtype"] == dtype}
            assert {64, 128} <= dims and {32, 96, 256} <= dims, (arch, dtype, dims)


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
    from burstcu.kernels.compile import gate_failure

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
    from burstcu.ops.kernel_ops import KernelOps

    ops = KernelOps("emulated")
    ops.smem_limit = 101376  # e.g. RTX 4090, L40S
    assert ops.headdim_problem(64) is None and ops.headdim_problem(64, backward=True) is None
    assert ops.headdim_problem(256) is None                       # the forward fits
    assert "shared memory" in ops.headdim_problem(256, backward=True)
    ops.deterministic = True
    assert "bwd_dq" in ops.headdim_problem(128, backward=True)


def test_sm86_table_runs_every_headdim_on_99KB():
    """The table those GPUs get: nothing refused, forward or backward, either mode."""
    from burstcu.ops.kernel_ops import KernelOps

    for deterministic in (False, True):
        ops = KernelOps("emulated", arch="sm_86", deterministic=deterministic)
        ops.smem_limit = SM86_SMEM_PER_BLOCK
        for d in (32, 40, 64, 96, 128, 200, 256):
            assert ops.headdim_problem(d) is None, d
            assert ops.headdim_problem(d, backward=True) is None, (d, deterministic)


@pytest.mark.parametrize("cc,table", [(80, "sm_80"), (86, "sm_86"), (87, "sm_86"), (89, "sm_86"),
                                      (90, "sm_90"), (100, "sm_90"), (103, "sm_90"),
                                      (110, "sm_86"), (120, "sm_86"), (121, "sm_86")])
def test_device_table_arch(cc, table):
    from burstcu.ops.kernel_ops import table_arch_for

    assert table_arch_for(cc) == table


def test_device_table_arch_refuses_pre_ampere():
    from burstcu.ops.kernel_ops import table_arch_for

    with pytest.raises(RuntimeError, match="8.0"):
        table_arch_for(75)


def test_sizes_beyond_32bit_element_counts_are_accepted():
    """Forward and backward kernels take 64-bit strides: 2^31 elements and more are no problem."""
    import numpy as np

    from burstcu.ops.kernel_ops import KernelOps

    ops = KernelOps("emulated")
    small = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (1, 1024, 8, 64), (0, 0, 0, 0))
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (2, 2**20, 16, 64), (0, 0, 0, 0))
    assert ops.input_problem(small, small, backward=True) is None
    assert ops.input_problem(huge, huge) is None
    assert ops.input_problem(huge, huge, backward=True) is None


def test_an_unknown_family_is_refused_with_the_families(capsys):
    from burstcu.kernels.__main__ import main
    with pytest.raises(SystemExit) as stop:
        main(["check", "--family", "fwd"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown family ['fwd']" in err and "forward" in err and "nonfinite_flag" in err
