"""The host mirrors of the kernels' parameter structs (`burstcu.ops.cuda.params`) against the C structs
of kernels/params.cuh (decode's: kernels/flash_decode.cu): size, alignment, member count and
every member's offset, size and kind as g++ lays them out (through the emulator's build, one a
source), and sizes, alignments and offsets as NVRTC does
(read from a probe kernel's PTX; needs cuda-python, not a GPU). A field added to, dropped from or
moved in one side only fails here.
"""

from __future__ import annotations

import re
from burstcu.build.variants import kernel_dir

import numpy as np
import pytest

from burstcu.layout import Block
from burstcu.ops.cuda import params
from burstcu.ops.cuda.params import NO_BOUND, PARAM_STRUCTS, CStruct
from burstcu.build.emulate import struct_layout, struct_layouts
from burstcu.ops.cuda.decode import DECODE_STRUCTS

pytestmark = pytest.mark.emulated

KIND = {"ptr": "p", "i64": "i", "i32": "i", "f32": "f", "tmap": "s"}
ELEMENT_TYPES = ("__half", "__nv_bfloat16", "float")


def instances(st: CStruct) -> list[str]:
    """The C++ types of `st` to check (a template's layout may not depend on T: every T)."""
    return [f"{st.name}<{t}>" for t in ELEMENT_TYPES] if st.templated else [st.name]


# (kernel source, host mirror, C++ type): the parameter structs, and decode's of its own source
CASES = ([("params.cuh", st, name) for st in PARAM_STRUCTS for name in instances(st)]
         + [("flash_decode.cu", st, name) for st in DECODE_STRUCTS for name in instances(st)])
SOURCES = sorted({source for source, _, _ in CASES})


@pytest.fixture(scope="module")
def gxx_layouts() -> dict:
    """{(source, C++ type): `struct_layout`} of every case, one g++ build a source."""
    found = {}
    for source in SOURCES:
        types = {cxx: [m for m, *_ in st.layout()] for src, st, cxx in CASES if src == source}
        found.update({(source, cxx): got for cxx, got in struct_layouts(source, types).items()})
    return found


@pytest.mark.parametrize("source,st,cxx", CASES, ids=[c for _, _, c in CASES])
def test_host_layout_matches_gxx(gxx_layouts, source, st, cxx):
    got = gxx_layouts[(source, cxx)]
    assert (got["size"], got["align"]) == (st.dtype.itemsize, st.alignment), cxx
    assert got["count"] == len(st.fields), f"{cxx} has {got['count']} members, the host {len(st.fields)}"
    for path, offset, size, typ in st.layout():
        assert got["members"][path] == (offset, size, KIND[typ]), f"{cxx}.{path}"


def test_one_type_alone_is_laid_out_as_among_many(gxx_layouts):
    """`struct_layout` of one type (its own build) gives what the build of every type gave."""
    source, st, cxx = CASES[-1]
    assert struct_layout(source, cxx, [m for m, *_ in st.layout()]) == gxx_layouts[(source, cxx)]


def nvrtc_ptx(source: str) -> str:
    """PTX of `source` (kernels/ on the include path) for compute_80, with the compile gate's
    options otherwise."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    pytest.importorskip("cuda.pathfinder")
    from burstcu.build.compile import nvrtc_options

    opts = [o for o in nvrtc_options("compute_80") if not o.startswith("--gpu-architecture")]
    opts = [o.encode() for o in (*opts, "--gpu-architecture=compute_80")]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"layout_probe.cu", 0, [], [])
    try:
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert res == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode().rstrip("\0 ")


def stored_constants(ptx: str) -> dict[int, int]:
    """{index: value} of the `out[index] = constant` stores of a probe kernel's PTX."""
    regs = dict(re.findall(r"mov\.u64\s+(%rd\d+), (\d+);", ptx))
    out = {}
    for offset, src in re.findall(r"st\.global\.u64\s+\[%rd\d+\+?(\d*)\], (%rd\d+|\d+);", ptx):
        out[int(offset or 0) // 8] = int(regs.get(src, src))
    return out


def test_host_layout_matches_nvrtc():
    """Sizes, alignments, offsets and member sizes as NVRTC (the compiler of the GPU kernels) lays
    them out: a probe kernel stores them as constants, which the PTX shows (no GPU needed)."""
    lines, expected = [f'#include "{source}"' for source in SOURCES] + [
        'extern "C" __global__ void layout_probe(unsigned long long* out) {'], []
    for _, st, cxx in CASES:
        ptr = f"static_cast<{cxx}*>(nullptr)"
        facts = [(f"sizeof({cxx})", st.dtype.itemsize, f"sizeof {cxx}"),
                 (f"alignof({cxx})", st.alignment, f"alignof {cxx}")]
        for path, offset, size, _ in st.layout():
            facts += [(f"(unsigned long long)&{ptr}->{path}", offset, f"offset of {cxx}.{path}"),
                      (f"sizeof({ptr}->{path})", size, f"size of {cxx}.{path}")]
        for expr, value, what in facts:
            lines.append(f"  out[{len(expected)}] = {expr};")
            expected.append((value, what))
    got = stored_constants(nvrtc_ptx("\n".join(lines + ["}"]) + "\n"))
    assert len(got) == len(expected)
    mismatches = [f"{what}: NVRTC {got[i]}, host {value}" for i, (value, what) in enumerate(expected)
                  if got[i] != value]
    assert not mismatches, mismatches


def test_every_struct_of_the_header_is_mirrored():
    text = (kernel_dir() / "params.cuh").read_text()
    declared = {[w for w in line.split() if not w.startswith("__align__")][1]
                for line in text.splitlines() if line.startswith("struct ")}
    # TensorMap is opaque: the host mirrors it as the "tmap" field type (128 bytes, align 64);
    # QueryTiles is a device-side view of a BlockRect (query_tiles), never passed by the host
    assert declared == {st.name for st in PARAM_STRUCTS} | {"TensorMap", "QueryTiles"}


def test_tensor_map_fields_are_64_byte_aligned_and_128_bytes():
    st = params.FWD_STEP_SM90
    assert st.alignment == 64 and st.dtype.itemsize % 64 == 0
    assert [st.dtype.fields[n][1] for n in ("q_map", "k_map", "v_map")] == [0, 128, 256]


# ------------------------------------------------------------------------------------------------
# the builders


def test_pack_refuses_missing_unknown_and_out_of_range_fields():
    with pytest.raises(TypeError, match=r"missing fields \['h'\], unknown fields \['x'\]"):
        params.ROW_STRIDES.pack(b=1, s=2, x=3)
    with pytest.raises(OverflowError):
        params.BLOCK_RECT.pack(q_start=2**31, q_len=1, k_start=0, k_len=1, q_pos=0, k_pos=0,
                               hi=0, lo=0)


@pytest.mark.parametrize("seed", range(4))
def test_a_setter_writes_its_fields_and_keeps_the_template(seed):
    """`CStruct.setter` against field-by-field assignment into a NumPy structured array: random
    scalar fields of every struct set to random values (adjacent ones and not, in any order),
    the others the template's, byte for byte."""
    rng = np.random.default_rng(seed)
    for st in PARAM_STRUCTS:
        scalars = [n for n, t in st.fields if t in ("ptr", "i64", "i32", "f32")]
        template = np.frombuffer(rng.integers(0, 256, st.dtype.itemsize, np.uint8).tobytes(), st.dtype).copy()
        some = list(rng.permutation(scalars)[:rng.integers(1, len(scalars) + 1)])
        for names in (some, scalars):       # any order (values by index); declaration order (slices)
            values = []
            for n in names:
                kind = st.dtype.fields[n][0]
                values.append(float(np.float32(rng.normal())) if kind.kind == "f" else int(
                    rng.integers(np.iinfo(kind).min, np.iinfo(kind).max, dtype=kind, endpoint=True)))
            want = np.frombuffer(bytearray(template.tobytes()), st.dtype)   # padding bytes kept
            for n, value in zip(names, values):
                want[n] = value
            got = st.setter(names)(template.tobytes(), *values)
            assert isinstance(got, np.void) and got.dtype == st.dtype
            assert got.tobytes() == want.tobytes(), (st.name, names)
    with pytest.raises(TypeError, match="not a scalar field"):
        params.FWD_STEP.setter(["q_stride"])


def test_fwd_step_params_fields():
    q = np.zeros((2, 16, 4, 64), np.float16)
    k = np.zeros((2, 24, 2, 64), np.float16)
    v = np.zeros_like(k)
    acc = np.zeros((2, 16, 4, 64), np.float32)
    m, l = np.zeros((2, 4, 16), np.float32), np.zeros((2, 4, 16), np.float32)
    flag = np.zeros(1, np.int32)
    blk = Block(q_start=3, q_len=5, k_start=4, k_len=6, q_pos=103, k_pos=104, causal=True)
    p = params.fwd_step_params(q, k, v, acc, m, l, flag, blk, 0.5)
    assert p.dtype == params.FWD_STEP.dtype and p.dtype.itemsize == 280
    assert int(p["q"]) == q.ctypes.data and int(p["nonfinite"]) == flag.ctypes.data
    assert tuple(p["kv_stride"]) == (24 * 2 * 64, 2 * 64, 64)
    assert tuple(p["ml_stride"]) == (4 * 16, 16)
    assert tuple(p["blk"]) == (3, 5, 4, 6, 103, 104, 0, NO_BOUND)
    assert (int(p["H"]), int(p["Hkv"]), float(p["scale_log2"])) == (4, 2, 0.5)
    assert (int(p["rects"]), int(p["groups"]), int(p["n_groups"])) == (0, 0, 0)   # one rectangle
    assert int(p["row_keys"]) == 0                                                   # not packed
    assert (int(p["out"]), int(p["lse"])) == (0, 0)                                  # not a pass
    # flash_fwd_pass: no state, out and lse with their strides
    out, lse = np.zeros((2, 16, 4, 64), np.float16), np.zeros((2, 4, 20), np.float32)[..., 2:18]
    p = params.fwd_step_params(q, k, v, None, None, None, flag, blk, 0.5, out=out, lse=lse)
    assert (int(p["acc"]), int(p["m"]), int(p["l"])) == (0, 0, 0)
    assert tuple(p["acc_stride"]) == (0, 0, 0) and tuple(p["ml_stride"]) == (0, 0)
    assert (int(p["out"]), int(p["lse"])) == (out.ctypes.data, lse.ctypes.data)
    assert tuple(p["out_stride"]) == (16 * 4 * 64, 4 * 64, 64) and tuple(p["lse_stride"]) == (4 * 20, 20)


def test_step_groups_group_by_query_range_in_folding_order():
    """flash_fwd_steps' lists: rectangles grouped by (q_start, q_len) in the order of each
    group's first block, blocks in order within a group; each group's first rectangle and first
    query tile as prefix sums; one buffer, both pointers into it."""
    blocks = [Block(0, 40, 0, 10, 0, 0, False), Block(40, 20, 0, 10, 90, 0, False),
              Block(0, 40, 10, 5, 0, 50, True), Block(40, 20, 10, 5, 90, 50, False)]
    groups = params.step_groups(np, blocks, 16)
    rects = groups.rects.reshape(-1, 8)
    assert [tuple(r[:4]) for r in rects] == [(0, 40, 0, 10), (0, 40, 10, 5), (40, 20, 0, 10),
                                            (40, 20, 10, 5)]
    assert tuple(rects[1][6:]) == (0, NO_BOUND)                       # causal: hi 0, no lower bound
    assert groups.n_groups == 2 and list(groups.offsets) == [0, 2, 4, 0, 3, 5]
    assert groups.tiles == 5                                          # ceil(40/16) + ceil(20/16)
    assert groups.offsets.ctypes.data == groups.rects.ctypes.data + 4 * 8 * 4
    p = params.fwd_step_params(np.zeros((1, 60, 2, 64), np.float16), *(np.zeros((1, 15, 2, 64), np.float16),) * 2,
                               np.zeros((1, 60, 2, 64), np.float32), *(np.zeros((1, 2, 60), np.float32),) * 2,
                               np.zeros(1, np.int32), None, 0.5, groups)
    assert int(p["rects"]) == groups.rects.ctypes.data and int(p["n_groups"]) == 2
    assert tuple(p["blk"]) == (0,) * 8


def test_bwd_step_params_take_64bit_strides_and_check_shared_ones():
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.float16), (1, 2, 1, 64), (0, 2**34, 0, 2))
    stat = np.zeros((1, 1, 2), np.float32)
    grad = np.zeros((1, 2, 1, 64), np.float32)
    blk = Block(q_start=0, q_len=2, k_start=0, k_len=2, q_pos=0, k_pos=0, causal=False)
    p = params.bwd_step_params(big, big, big, big, stat, stat, grad, grad, grad, None,
                               np.zeros(1, np.int32), blk, 0.125)
    assert int(p["q_stride"]["s"]) == 2**33 and int(p["psum"]) == 0
    other = np.zeros((1, 2, 1, 64), np.float16)
    with pytest.raises(ValueError, match="share their strides"):
        params.bwd_step_params(big, other, big, big, stat, stat, grad, grad, grad, None,
                               np.zeros(1, np.int32), blk, 0.125)


def test_strides_of_length_one_dims_need_not_agree():
    """A dim of size 1 is only ever indexed at 0: tensors that differ in its stride alone share
    their strides (NumPy and CuPy keep such strides on contiguous copies)."""
    a = np.zeros((1, 24, 2, 32), np.float16)
    b = np.lib.stride_tricks.as_strided(np.zeros(24 * 2 * 32, np.float16), a.shape, (64, 128, 64, 2))
    assert params._shared_strides(3, a, b) == (24 * 2 * 32, 64, 32)


def _groups_block_by_block(blocks, by: str, tile_rows: int):
    """(rects (n, 8), offsets, tiles) of `blocks` grouped by hand: a dict of ranges in the order
    of first appearance, blocks in order within each (what flash_*_steps launches read)."""
    start, length = {"query": ("q_start", "q_len"), "key": ("k_start", "k_len")}[by]
    groups: dict = {}
    for blk in blocks:
        groups.setdefault((getattr(blk, start), getattr(blk, length)), []).append(blk)
    rects = [params.block_rect(blk) for members in groups.values() for blk in members]
    tiles = [-(-rows // tile_rows) for _, rows in groups]
    offsets = list(np.cumsum([0] + [len(m) for m in groups.values()])) + list(np.cumsum([0] + tiles))
    return np.array(rects, np.int64).reshape(-1, 8), offsets, sum(tiles)


@pytest.mark.parametrize("seed", range(3))
def test_step_lists_of_a_step_array_are_the_blocks_grouped_by_hand(seed):
    """step_group_lists of a ring step as `layout.blocks` gives it (a StepBlocks: whole-array
    grouping from its RECTANGLE array) and of the same Blocks in a plain list (read block by
    block) both equal the grouping done by hand, by query and by key range, for random documents,
    windows and causal masks over 2-4 zigzag ranks; every such step is listable."""
    from burstcu import layout

    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 5))
    n = int(rng.integers(4 * size, 300))
    cuts = np.sort(rng.choice(np.arange(1, n), size=int(rng.integers(1, 12)), replace=False))
    docs = (0, *map(int, cuts), n)
    part = layout.partition("zigzag", size, n, docs)
    steps = 0
    for causal, window in ((True, (-1, -1)), (True, (9, 0)), (False, (5, 3))):
        for qr in range(size):
            for kr in range(size):
                blocks = layout.blocks(part, qr, kr, causal, window, docs)
                if not blocks:
                    continue
                assert blocks is layout.blocks(part, qr, kr, causal, list(window), list(docs))
                assert params.listable(blocks, ["query", "key"])
                groupings = [("query", 16), ("key", 64)]
                for given in (blocks, list(blocks)):
                    for (by, rows), got in zip(groupings, params.step_group_lists(np, given, groupings)):
                        rects, offsets, tiles = _groups_block_by_block(blocks, by, rows)
                        assert np.array_equal(got.rects.reshape(-1, 8), rects)
                        assert list(got.offsets) == offsets and got.tiles == tiles
                        assert got.n_groups == len(offsets) // 2 - 1
                steps += 1
    assert steps >= 3


def test_overlapping_ranges_are_not_listable_either_way():
    """Two query ranges that overlap without being equal ([0, 40) and [20, 50)): not listable,
    and step_group_lists refuses them, from Blocks and from a step's array alike."""
    from burstcu.layout import RECTANGLE, StepBlocks

    rows = [(0, 40, 0, 10, 0, 0, False, -1, -1), (20, 30, 10, 10, 20, 10, True, -1, -1)]
    for blocks in ([Block(*r) for r in rows], StepBlocks(np.array(rows, RECTANGLE))):
        assert params.listable(blocks, ["key"]) and not params.listable(blocks, ["query"])
        with pytest.raises(ValueError, match="overlap without being equal"):
            params.step_group_lists(np, blocks, [("query", 16)])
        assert params.any_masked(blocks)
        with pytest.raises(ValueError, match="lies outside q rows"):
            params.check_rows(blocks, 49, 20)


def test_a_rectangle_list_beyond_int32_is_refused():
    """A bound the kernels' int32 rectangles cannot hold (left = 2^31 + 5) raises instead of
    wrapping into another bound."""
    blocks = [Block(0, 8, 0, 8, 0, 0, False, left=2**31 + 5), Block(8, 8, 0, 8, 8, 0, False)]
    with pytest.raises(ValueError, match="beyond int32"):
        params.step_group_lists(np, blocks, [("query", 16)])


def _listable_rows(rng) -> list[tuple]:
    """Up to 40 random RECTANGLE rows whose query ranges cut [0, 200) and key ranges [0, 150)
    into runs (every two equal or disjoint), some of them empty at a run's start."""
    def runs(total: int) -> list[tuple[int, int]]:
        cuts = np.sort(rng.choice(np.arange(1, total), size=int(rng.integers(1, 9)), replace=False))
        bounds = [0, *cuts.tolist(), total]
        out = list(zip(bounds[:-1], np.diff(bounds).tolist()))
        return out + [(out[int(rng.integers(len(out)))][0], 0)] * int(rng.integers(2))
    q_runs, k_runs = runs(200), runs(150)
    rows = []
    for _ in range(int(rng.integers(1, 41))):
        (qs, ql), (ks, kl) = q_runs[rng.integers(len(q_runs))], k_runs[rng.integers(len(k_runs))]
        rows.append((qs, ql, ks, kl, int(rng.integers(0, 500)), int(rng.integers(0, 500)),
                     bool(rng.integers(2)), int(rng.choice([-1, 0, 9])), int(rng.choice([-1, 3]))))
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_ranges_in_order_are_grouped_without_a_sort_as_with_one(seed, monkeypatch):
    """Blocks whose ranges already ascend are grouped without a sort (`params._range_order`
    None): the same StepGroups, bit for bit, as the sorting path gives them (forced), for random
    listable sets in query-range order, key-range order or shuffled, from Blocks and from a
    step's array, and the grouping by hand; a set with two query ranges that overlap without
    being equal, in ascending order or not, is refused either way."""
    from burstcu.layout import RECTANGLE, StepBlocks

    rng = np.random.default_rng(seed)
    groupings = [("query", 16), ("key", 64)]
    real, unsorted = params._range_order, []
    spy = lambda key: unsorted.append(real(key) is None) or real(key)   # noqa: E731
    for trial in range(60):
        rows = _listable_rows(rng)
        overlapping = trial % 5 == 4
        if overlapping:   # query rows [10, 30) and [15, 35)
            rows += [(10, 20, *rows[0][2:]), (15, 20, *rows[-1][2:])]
        if trial % 3 < 2:
            rows.sort(key=lambda r: r[2 * (trial % 3):2 * (trial % 3) + 2])
        results = []
        for order in (spy, lambda key: key.argsort(kind="stable")):
            monkeypatch.setattr(params, "_range_order", order)
            for blocks in ([Block(*r) for r in rows], StepBlocks(np.array(rows, RECTANGLE))):
                try:
                    got = params.step_group_lists(np, blocks, groupings)
                except ValueError as e:
                    results.append(str(e))
                    continue
                results.append([(g.rects.dtype, g.rects.tobytes(), g.offsets.dtype,
                                 g.offsets.tobytes(), g.n_groups, g.tiles) for g in got])
        assert all(r == results[0] for r in results), rows
        if overlapping:
            assert "overlap without being equal" in results[0]
            continue
        blocks = [Block(*r) for r in rows]
        for (by, tile_rows), (_, rects, _, offsets, n_groups, tiles) in zip(groupings, results[0]):
            want_rects, want_offsets, want_tiles = _groups_block_by_block(blocks, by, tile_rows)
            assert np.frombuffer(rects, np.int32).reshape(-1, 8).tolist() == want_rects.tolist()
            assert np.frombuffer(offsets, np.int32).tolist() == want_offsets
            assert (n_groups, tiles) == (len(want_offsets) // 2 - 1, want_tiles)
    assert sum(unsorted) >= 40 and not all(unsorted)   # both paths taken
