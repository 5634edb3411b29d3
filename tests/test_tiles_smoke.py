"""bench/gpu/tiles.py on the CPU: the dry run, a gate of a tiny candidate subset, the committed
candidate file, and the measuring path on the kernel emulator at toy sizes (a few seconds in all;
the GPU run itself is not testable here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
COMMITTED = BENCH / "results" / "h100" / "tile_candidates.json"
sys.path.insert(0, str(ROOT))     # bench/ is imported as the package `bench`


def run_tiles(args: list, timeout: float = 60, cache: Path | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if cache is not None:
        env["BURSTCU_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, str(BENCH / "gpu" / "tiles.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"tiles.py {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_variants_for_tiles_match_the_tables():
    from burstcu.build import bwd_variants, fwd_variants
    from burstcu.build import all_variants
    from burstcu.build.variants import ARCHS, DTYPES

    from bench.gpu import tiles

    for arch in ARCHS:
        for v in all_variants(arch):
            if v.family in tiles.FAMILIES:
                assert tiles.make_variant(v.family, v.dtype, v.headdim, tiles.tiles_of(v)) == v
            elif v.family == "forward_sm90_careful":
                _, bn, stages = tiles.tiles_of(v)
                assert fwd_variants.sm90_variant_for_tiles(v.dtype, v.headdim, bn, stages,
                                                           careful=True) == v
            elif v.family == "bwd_dkdv_nodq":
                bm, bn, wd = tiles.tiles_of(v)
                assert bwd_variants.dkdv_variant_for_tiles(v.dtype, v.headdim, bm, bn, wd,
                                                           with_dq=False) == v
    with pytest.raises(ValueError):
        fwd_variants.step_variant_for_tiles(DTYPES[0], 64, 4, 40)
    with pytest.raises(ValueError):
        bwd_variants.dq_variant_for_tiles(DTYPES[0], 256, 64, 32, 32)
    for bad in ((96, 128, 2), (128, 96, 2), (128, 128, 1)):   # head dim, BLOCK_N, STAGES
        with pytest.raises(ValueError):
            fwd_variants.sm90_variant_for_tiles(DTYPES[0], *bad)
    with pytest.raises(ValueError):
        tiles.make_variant("forward_sm90", DTYPES[0], 128, (64, 128, 2))   # BLOCK_M is 128


def test_dry_run():
    out = run_tiles(["--dry-run"])
    assert "dry run: nothing compiled" in out and "estimate on one H100" in out
    for family in ("forward", "bwd_dkdv", "bwd_dq"):
        assert family in out
    assert "flash_fwd_step<__half, 64, 64, 64, 4>" in out  # the sm_90 table's d = 64 forward


def test_gate_tiny_subset(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    pytest.importorskip("cuda.pathfinder")
    path = tmp_path / "cands.json"
    out = run_tiles(["--gate", "--headdims", 64, "--families", "forward", "--max-candidates", 2,
                     "--jobs", 2, "--candidates", path])
    assert "2/2 candidates kept" in out, out
    data = json.loads(path.read_text())
    cands = data["candidates"]
    assert len(cands) == 2 and cands[0]["current"] and not cands[1]["current"]
    for c in cands:
        assert c["error"] is None and c["registers"] > 0 and c["spill_stores"] == 0
        assert 0 < c["occupancy"] <= 1 and c["family"] == "forward" and c["headdim"] == 64
    assert set(data["source_digests"]) == {"flash_fwd.cu"}    # the gated families' sources only
    # the file is what a GPU run reads: its dry run takes the candidates from it, gating nothing
    out = run_tiles(["--dry-run", "--headdims", 64, "--families", "forward", "--candidates", path])
    assert "2 candidates (2 from" in out and "0 to gate" in out


def test_committed_candidates_cover_the_default_run():
    from bench.gpu import tiles

    data = json.loads(COMMITTED.read_text())
    assert data["tile_table"] == "sm_90"
    cands = data["candidates"]
    groups = {(c["family"], c["dtype"], c["headdim"]) for c in cands}
    assert groups == {(f, "float16", d) for f in tiles.MMA_SYNC_FAMILIES for d in (64, 128, 256)}
    for key in groups:
        assert sum(c["current"] for c in cands if (c["family"], c["dtype"], c["headdim"]) == key) == 1
    for c in cands:
        assert c["error"] is None and c["spill_stores"] == 0 and c["spill_loads"] == 0
        assert c["registers"] <= 255 and c["smem_bytes"] <= 227 * 1024
    # the default GPU run over these candidates must fit one call of about four minutes (a
    # kernel edit since the gate makes the GPU run gate again first, which --gate here avoids)
    args = tiles.parse([])
    rows = tiles.plan(tiles.select(tiles.refresh_current(cands, args), args), args)
    assert tiles.estimate_seconds(rows, args)["total_s"] < 220


def test_committed_hopper_candidates_cover_their_run():
    """bench/results/h200/tile_candidates_sm90a.json (the run.sh step tiles_sm90): every
    Hopper forward group of both dtypes, the table's tiles marked once each, all through the gate
    (no spill, HGMMA in the SASS, no local memory), within one call of a GPU run."""
    from bench.gpu import tiles

    data = json.loads((BENCH / "results" / "h200" / "tile_candidates_sm90a.json").read_text())
    assert data["tile_table"] == "sm_90a"
    # gated for the kernel as it is: the GPU run then measures at once, gating nothing again
    assert data["source_digests"] == tiles.source_digests(["forward_sm90"])
    cands = data["candidates"]
    groups = {(c["family"], c["dtype"], c["headdim"]) for c in cands}
    assert groups == {("forward_sm90", dt, d) for dt in ("float16", "bfloat16") for d in (64, 128, 256)}
    for key in groups:
        assert sum(c["current"] for c in cands if (c["family"], c["dtype"], c["headdim"]) == key) == 1
    for c in cands:
        assert c["error"] is None and c["spill_stores"] == 0 and c["smem_bytes"] <= 227 * 1024
    assert {tuple(c["tiles"]) for c in cands if c["headdim"] == 128} >= {(128, 128, 2), (128, 128, 3)}
    args = tiles.parse(["--tile-table", "sm_90a", "--dtypes", "float16", "bfloat16"])
    assert args.families == ["forward_sm90"]
    rows = tiles.plan(tiles.select(tiles.refresh_current(cands, args), args), args)
    assert tiles.estimate_seconds(rows, args)["total_s"] < 220
    with pytest.raises(SystemExit):   # the Hopper family exists on the sm_90a table only
        tiles.parse(["--families", "forward_sm90"])


@pytest.mark.emulated
def test_hopper_measure_path_on_the_emulator(tmp_path):
    """The GPU-run path for forward_sm90 on the emulator: a candidate with another pipeline depth
    runs through the pinned Hopper kernel and matches the table's."""
    from bench.gpu import tiles

    cands = [c for c in tiles.enumerate_candidates("sm_90a", ["forward_sm90"], ["float16"], [64])
             if tuple(c["tiles"]) in {(128, 128, 3), (128, 64, 2)}]
    src = {"tile_table": "sm_90a", "source_digests": tiles.source_digests(["forward_sm90"]),
           "candidates": cands}
    cpath, jpath = tmp_path / "c.json", tmp_path / "r.json"
    cpath.write_text(json.dumps(src))
    run_tiles(["--backend", "emulated", "--tile-table", "sm_90a", "--headdims", 64, "--seqlens", 192,
               "--tokens", 192, "--width", 64, "--warmup", 0, "--repeats", 1, "--candidates", cpath,
               "--json", jpath], timeout=300, cache=tmp_path / "cache")
    rows = {r["tiles"]: r for r in json.loads(jpath.read_text())["rows"]}
    assert rows["128x128x3"]["current"] and rows["128x128x3"]["check"] == "ok"
    assert rows["128x64x2"]["check"] == "ok" and rows["128x64x2"]["ms"] > 0, rows["128x64x2"]
    # and the pin reaches the launch: the candidate's kernel is what the forward step asks for
    ops = tiles.make_ops("sm_90a", "emulated")
    asked, function = [], ops.function
    ops.function = lambda name: asked.append(name) or function(name)
    candidate = tiles.make_variant("forward_sm90", "float16", 64, (128, 64, 2))
    ops.pin(candidate)
    tiles.Inputs(ops, "float16", 1, 130, 1, 64).step("forward_sm90")[0]()
    assert candidate.name in asked and "flash_fwd_step_sm90<__half, 64, 128, 3>" not in asked, asked


@pytest.mark.emulated
def test_measure_path_on_the_emulator(tmp_path):
    """The whole GPU-run path (pinning, checks, timing, tables, JSON) on the kernel emulator,
    with a candidate that cannot be built: it is reported and the others still run."""
    from bench.gpu import tiles

    cands = tiles.enumerate_candidates("sm_90", ["forward"], ["float16"], [64], max_per_group=2)
    bad = {**cands[1], "tiles": [64, 40, 4], "name": "illegal"}
    src = {"tile_table": "sm_90", "source_digests": tiles.source_digests(["forward"]),
           "candidates": cands + [bad]}
    cpath, jpath = tmp_path / "c.json", tmp_path / "r.json"
    cpath.write_text(json.dumps(src))
    out = run_tiles(["--backend", "emulated", "--families", "forward", "--headdims", 64,
                     "--seqlens", 32, "--tokens", 32, "--width", 128, "--warmup", 0,
                     "--repeats", 1, "--candidates", cpath, "--json", jpath],
                    timeout=120, cache=tmp_path / "cache")
    assert "best tiles per family" in out
    result = json.loads(jpath.read_text())
    assert result["complete"]
    rows = {r["tiles"]: r for r in result["rows"]}
    assert rows["64x64x4"]["current"] and rows["64x64x4"]["check"] == "ok"
    assert rows["64x32x4"]["check"] == "ok" and rows["64x32x4"]["ms"] > 0
    assert rows["64x40x4"]["status"].startswith("error: ValueError")
