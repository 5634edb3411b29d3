"""What the CUDA kernels' launchers (`kernel_ops`, `backward`, `decode`) share: the kernels' parameter
structs, mirrored from kernels/params.cuh, and argument helpers.

Every kernel takes one struct by value. Each struct is declared here once, as a `CStruct` with
the C struct's fields in the C declaration order; its `dtype` is the NumPy structured dtype with
C's natural-alignment layout, and one builder function per struct (`fwd_step_params`,
`fwd_finalize_params`, `nonfinite_params`, `bwd_delta_params`, `bwd_step_params`) fills it from
the launch's arrays and returns a ``numpy.void`` scalar. That scalar is the kernel's one
argument on both backends: CuPy (``RawKernel``, cupy-cuda13x 14.x) turns a NumPy scalar into a
`CScalar` holding its bytes and hands the driver a pointer to them, and the driver copies the
struct's size from there into the kernel's parameter space; the emulator
(`burstcu.build.emulate`) copies the same bytes into the C++ struct. Pointers travel as their
addresses (64-bit unsigned integers). tests/kernels/test_params_layout.py checks every size,
alignment and offset against what g++ and NVRTC make of kernels/params.cuh.

Arrays are CuPy (a GPU) or NumPy (the emulator); every helper works on both. The structs hold raw
addresses, so the arrays must stay alive until the kernel has read them: the launchers keep them
referenced until after the launch, and CuPy's memory pool reuses a freed block only in stream
order, after the kernels already queued on that stream.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import numpy as np

from ...layout import Block, masked_rows, ragged, rectangle_rows
from . import packing

I32_MAX = 2**31 - 1
MAX_GRID_YZ = 65535   # a launch grid's y and z (CUDA's limit): the kernels put B and H there
# "no bound" for the kernels' key bounds: large enough for any sequence, small enough that a
# position (below 2^30) plus it stays within int32
NO_BOUND = 1 << 29
MAX_POSITION = 1 << 30


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def data_ptr(x) -> int:
    """The address of x's first element (CuPy or NumPy)."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    ptr = getattr(getattr(x, "data", None), "ptr", None)  # CuPy: the first element's MemoryPointer
    return int(ptr) if ptr is not None else int(x.__cuda_array_interface__["data"][0])


def element_strides(x) -> tuple[int, ...]:
    """Strides in elements."""
    itemsize = x.itemsize
    return tuple([s // itemsize for s in x.strides])


def rows_on_16_bytes(*xs) -> bool:
    """Whether every row (last dim) of each x is contiguous and starts on 16 bytes: a unit last
    stride, an aligned first element and other strides of whole 16-byte units (the kernels'
    uint4 / float4 accesses)."""
    return all(x.strides[-1] == x.itemsize and data_ptr(x) % 16 == 0
               and all(st % 16 == 0 for st in x.strides[:-1]) for x in xs)


def vector_ready(xp, x):
    """x itself if cp.async can read it (16-byte aligned base, last dim contiguous, other strides
    non-negative multiples of 8 elements), else an aligned contiguous copy."""
    es = element_strides(x)
    ok = data_ptr(x) % 16 == 0 and es[-1] == 1 and all(s % 8 == 0 and s >= 0 for s in es[:-1])
    return x if ok else xp.array(x, order="C", copy=True)


def same_strides(xp, a, b):
    """(a, b) with identical element strides (the kernels take one stride triple for both).
    A copy made here is a fresh, hence aligned, allocation."""
    if a.strides == b.strides:
        return a, b
    return xp.ascontiguousarray(a), xp.ascontiguousarray(b)


def rows_contiguous(xp, x):
    """A (B, H, S) float32 row statistic with contiguous rows."""
    x = xp.asarray(x, dtype=np.float32)
    return x if element_strides(x)[-1] == 1 else xp.ascontiguousarray(x)


def key_bounds(block: Block) -> tuple[int, int]:
    """The kernels' (hi, lo) of a block: element (i, j) is kept iff
    q_pos + i - lo <= k_pos + j <= q_pos + i + hi (causal: hi = 0; a window cutting through the
    block: its right / left edge; no bound: NO_BOUND)."""
    hi = NO_BOUND
    if block.causal:
        hi = 0
    if block.right >= 0:
        hi = min(hi, block.right)
    lo = block.left if block.left >= 0 else NO_BOUND
    _check_reach(max(block.q_pos + block.q_len, block.k_pos + block.k_len))
    return hi, lo


def _check_reach(reach: int) -> None:
    if reach > MAX_POSITION:
        raise ValueError(f"global positions up to {MAX_POSITION} only (the kernels add bounds of "
                         f"up to 2^29 to them in int32); this block reaches {reach}")


# ------------------------------------------------------------------------------------------------
# the parameter structs (kernels/params.cuh)

_SCALARS = {"ptr": np.dtype(np.uint64), "i64": np.dtype(np.int64), "i32": np.dtype(np.int32),
            "f32": np.dtype(np.float32), "tmap": np.dtype((np.uint8, 128))}
_CTYPES = {"ptr": "pointer", "i64": "long long", "i32": "int", "f32": "float",
           "tmap": "TensorMap"}
# C alignment of each field type (a TensorMap is 64-byte aligned; NumPy cannot say so itself)
_ALIGN = {"ptr": 8, "i64": 8, "i32": 4, "f32": 4, "tmap": 64}
_PACK_CODES = {"ptr": "Q", "i64": "q", "i32": "i", "f32": "f"}     # `struct` codes, native order


class CStruct:
    """A C struct of kernels/params.cuh, field for field.

    name: the C++ type (`templated`: a template on the element type T, e.g. FwdStepParams<T>).
    fields: (name, type) in declaration order; type is "ptr" (any pointer, passed as its
    address), "i64" (long long), "i32" (int), "f32" (float), "tmap" (a TensorMap: 128 bytes,
    64-byte aligned, given as 128 uint8) or a nested CStruct.
    dtype: the NumPy structured dtype with C's layout (each field at the next multiple of its
    alignment, the size rounded up to the largest one); alignment: the C struct's.
    """

    def __init__(self, name: str, fields: Sequence[tuple[str, Union[str, "CStruct"]]],
                 templated: bool = False):
        self.name = name
        self.fields = tuple(fields)
        self.templated = templated
        self.names = tuple(n for n, _ in self.fields)
        offsets, offset, self.alignment = [], 0, 1
        for _, t in self.fields:
            align = t.alignment if isinstance(t, CStruct) else _ALIGN[t]
            offset = -(-offset // align) * align
            offsets.append(offset)
            offset += (t.dtype if isinstance(t, CStruct) else _SCALARS[t]).itemsize
            self.alignment = max(self.alignment, align)
        self.dtype = np.dtype({"names": list(self.names),
                               "formats": [t.dtype if isinstance(t, CStruct) else _SCALARS[t]
                                           for _, t in self.fields],
                               "offsets": offsets,
                               "itemsize": -(-offset // self.alignment) * self.alignment,
                               "aligned": True})
        self._pointers = [i for i, (_, t) in enumerate(self.fields) if t == "ptr"]

    def __repr__(self) -> str:
        return f"CStruct({self.name}, {self.dtype.itemsize} bytes)"

    def layout(self, prefix: str = "", base: int = 0) -> list[tuple[str, int, int, str]]:
        """Every scalar field, nested ones included, as (C member path such as "blk.q_len",
        byte offset, byte size, type name): what the layout test compares with C's offsetof."""
        out = []
        for name, typ in self.fields:
            offset = base + self.dtype.fields[name][1]
            if isinstance(typ, CStruct):
                out += typ.layout(f"{prefix}{name}.", offset)
            else:
                out.append((prefix + name, offset, _SCALARS[typ].itemsize, typ))
        return out

    def values(self, given: dict) -> tuple:
        """The field values of `given` (field name -> value) in declaration order: arrays (and
        None) become addresses for the pointer fields; numbers and nested structs (tuples in
        their field order) go as they are, and NumPy's assignment raises OverflowError for a
        value out of a field's range instead of wrapping it. TypeError names missing or unknown
        fields."""
        try:
            values = [given[name] for name in self.names]
        except KeyError:
            values = None
        if values is None or len(given) != len(self.names):
            missing = [n for n in self.names if n not in given]
            unknown = sorted(set(given) - set(self.names))
            raise TypeError(f"{self.name}: missing fields {missing}, unknown fields {unknown}")
        for i in self._pointers:
            values[i] = 0 if values[i] is None else data_ptr(values[i])
        return tuple(values)

    def pack(self, **given) -> np.void:
        """One struct as a numpy.void scalar: the kernel argument (see the module docstring)."""
        buf = np.empty(1, self.dtype)
        buf[0] = self.values(given)
        return buf[0]

    def setter(self, names: Sequence[str]) -> Callable[..., np.void]:
        """fill(template, *values) -> numpy.void: a copy of `template` (this struct's bytes, its
        other fields set once) with the scalar fields `names` set to `values`, in that order
        (pointers as int addresses). For launches that change a few fields a call (decode's
        addresses and counts): one copy and a few `struct.pack_into`, where assigning the fields
        of a structured array costs a microsecond or more apiece."""
        fields = sorted((self.dtype.fields[n][1], i, self.fields[self.names.index(n)][1])
                        for i, n in enumerate(names))
        runs: list[list] = []         # [offset, end, codes, value indices] of adjacent fields
        for offset, i, typ in fields:
            if typ not in _PACK_CODES:
                raise TypeError(f"{self.name}.{names[i]} is not a scalar field")
            if runs and runs[-1][1] == offset:
                runs[-1][1] += _SCALARS[typ].itemsize
                runs[-1][2] += _PACK_CODES[typ]
                runs[-1][3].append(i)
            else:
                runs.append([offset, offset + _SCALARS[typ].itemsize, _PACK_CODES[typ], [i]])
        # each run's values: a slice of the call's where `names` list them in the run's order
        plan = [(struct.Struct("=" + codes).pack_into, offset,      # the dtypes' native byte order
                 slice(order[0], order[-1] + 1) if order == list(range(order[0], order[-1] + 1))
                 else order) for offset, _, codes, order in runs]
        dtype, size = self.dtype, self.dtype.itemsize

        def fill(template: bytes, *values) -> np.void:
            assert len(template) == size and len(values) == len(names)
            raw = bytearray(template)
            for pack_into, offset, which in plan:
                pack_into(raw, offset,
                          *(values[which] if type(which) is slice else [values[i] for i in which]))
            return np.frombuffer(raw, dtype)[0]
        return fill


ROW_STRIDES = CStruct("RowStrides", [("b", "i64"), ("s", "i64"), ("h", "i64")])
STAT_STRIDES = CStruct("StatStrides", [("b", "i64"), ("h", "i64")])
BLOCK_RECT = CStruct("BlockRect", [("q_start", "i32"), ("q_len", "i32"), ("k_start", "i32"),
                                   ("k_len", "i32"), ("q_pos", "i32"), ("k_pos", "i32"),
                                   ("hi", "i32"), ("lo", "i32")])
FWD_STEP = CStruct("FwdStepParams", [
    ("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("acc", "ptr"), ("m", "ptr"), ("l", "ptr"),
    ("nonfinite", "ptr"), ("q_stride", ROW_STRIDES), ("kv_stride", ROW_STRIDES),
    ("acc_stride", ROW_STRIDES), ("ml_stride", STAT_STRIDES), ("blk", BLOCK_RECT),
    ("H", "i32"), ("Hkv", "i32"), ("scale_log2", "f32"), ("rects", "ptr"), ("groups", "ptr"),
    ("row_keys", "ptr"), ("n_groups", "i32"), ("out", "ptr"), ("lse", "ptr"),
    ("out_stride", ROW_STRIDES), ("lse_stride", STAT_STRIDES)], templated=True)
FWD_FINALIZE = CStruct("FwdFinalizeParams", [
    ("acc", "ptr"), ("m", "ptr"), ("l", "ptr"), ("out", "ptr"), ("lse", "ptr"),
    ("acc_stride", ROW_STRIDES), ("out_stride", ROW_STRIDES), ("ml_stride", STAT_STRIDES),
    ("lse_stride", STAT_STRIDES), ("S", "i32"), ("D", "i32"), ("vec", "i32")], templated=True)
NONFINITE = CStruct("NonfiniteParams", [
    ("x", "ptr"), ("flag", "ptr"), ("x_stride", ROW_STRIDES), ("S", "i32"), ("D", "i32"),
    ("vec", "i32")], templated=True)
BWD_DELTA = CStruct("BwdDeltaParams", [
    ("out", "ptr"), ("dout", "ptr"), ("delta", "ptr"), ("row_stride", ROW_STRIDES),
    ("delta_stride", STAT_STRIDES), ("B", "i32"), ("S", "i32"), ("H", "i32"), ("D", "i32")],
    templated=True)
BWD_STEP = CStruct("BwdStepParams", [
    ("q", "ptr"), ("dout", "ptr"), ("k", "ptr"), ("v", "ptr"), ("lse", "ptr"), ("delta", "ptr"),
    ("dq", "ptr"), ("dk", "ptr"), ("dv", "ptr"), ("psum", "ptr"), ("nonfinite", "ptr"),
    ("q_stride", ROW_STRIDES), ("k_stride", ROW_STRIDES), ("dq_stride", ROW_STRIDES),
    ("dk_stride", ROW_STRIDES), ("stat_stride", STAT_STRIDES), ("blk", BLOCK_RECT),
    ("H", "i32"), ("Hkv", "i32"), ("scale", "f32"), ("rects", "ptr"), ("groups", "ptr"),
    ("row_keys", "ptr"), ("key_rows", "ptr"), ("n_groups", "i32")], templated=True)
FWD_STEP_SM90 = CStruct("FwdStepSm90Params", [
    ("q_map", "tmap"), ("k_map", "tmap"), ("v_map", "tmap"), ("acc", "ptr"), ("m", "ptr"),
    ("l", "ptr"), ("nonfinite", "ptr"), ("acc_stride", ROW_STRIDES), ("ml_stride", STAT_STRIDES),
    ("blk", BLOCK_RECT), ("H", "i32"), ("Hkv", "i32"), ("scale_log2", "f32"), ("n_tiles", "i32"),
    ("hb_group", "i32"), ("n_groups", "i32"), ("rects", "ptr"), ("groups", "ptr"),
    ("row_keys", "ptr"), ("out", "ptr"), ("lse", "ptr"), ("out_stride", ROW_STRIDES),
    ("lse_stride", STAT_STRIDES), ("fresh", "i32"), ("finalize", "i32")])
BWD_STEP_SM90 = CStruct("BwdStepSm90Params", [
    ("q_map", "tmap"), ("do_map", "tmap"), ("k_map", "tmap"), ("v_map", "tmap"), ("dq_map", "tmap"),
    ("lse", "ptr"),
    ("delta", "ptr"), ("dq", "ptr"), ("dk", "ptr"), ("dv", "ptr"), ("nonfinite", "ptr"),
    ("dq_stride", ROW_STRIDES), ("dk_stride", ROW_STRIDES), ("stat_stride", STAT_STRIDES),
    ("blk", BLOCK_RECT), ("H", "i32"), ("Hkv", "i32"), ("scale", "f32"), ("n_groups", "i32"),
    ("rects", "ptr"), ("groups", "ptr"), ("key_rows", "ptr"), ("dq_adds", "i32")])
# every struct of kernels/params.cuh (the layout test walks this list)
PARAM_STRUCTS = (ROW_STRIDES, STAT_STRIDES, BLOCK_RECT, FWD_STEP, FWD_FINALIZE, NONFINITE,
                 BWD_DELTA, BWD_STEP, FWD_STEP_SM90, BWD_STEP_SM90)


def _shared_strides(n: int, x, *others) -> tuple[int, ...]:
    """The first n element strides of x, which every one of `others` must share (the kernels
    read them with one stride set) along each dim longer than 1 (the stride of a dim of size 1
    is never used); ValueError otherwise."""
    strides = element_strides(x)[:n]
    for y in others:
        theirs = element_strides(y)[:n]
        if theirs != strides and any(a != b and size > 1
                                     for a, b, size in zip(strides, theirs, y.shape)):
            raise ValueError(f"tensors of shapes {[tuple(t.shape) for t in (x, *others)]} must "
                             f"share their strides, not {[element_strides(t) for t in (x, *others)]}")
    return strides


def block_rect(block: Block) -> tuple:
    """A BlockRect: the block's rectangle and key bounds (`key_bounds`)."""
    return (block.q_start, block.q_len, block.k_start, block.k_len, block.q_pos, block.k_pos,
            *key_bounds(block))


def block_column(blocks: Sequence[Block], field: str) -> np.ndarray:
    """(n,) one `Block` field of every block (`burstcu.layout.rectangle_rows`)."""
    return rectangle_rows(blocks)[field]


def nonempty(blocks: Sequence[Block]) -> Sequence[Block]:
    """`blocks` less those without rows on both sides (a `burstcu.layout.StepBlocks` with none:
    itself, so what its memo keeps serves)."""
    facts = _step_facts(blocks)
    if facts is not None and not facts["empty"]:
        return blocks
    return [blk for blk in blocks if blk.q_len > 0 and blk.k_len > 0]


def any_masked(blocks: Sequence[Block]) -> bool:
    """Whether some block has a masked pair (`Block.masked`)."""
    facts = _step_facts(blocks)
    return facts["masked"] if facts is not None else any(blk.masked for blk in blocks)


def block_area(blocks: Sequence[Block]) -> int:
    """The (query, key) pairs of all blocks, masked ones included."""
    facts = _step_facts(blocks)
    return facts["area"] if facts is not None else sum(blk.q_len * blk.k_len for blk in blocks)


def check_rows(blocks: Sequence[Block], sq: int, sk: int) -> None:
    """ValueError naming the first block whose rows leave q rows [0, sq) or k rows [0, sk)."""
    facts = _step_facts(blocks)
    if facts is not None:
        q_first, q_end, k_first, k_end = facts["rows"]
        if q_first >= 0 and q_end <= sq and k_first >= 0 and k_end <= sk:
            return
    for blk in blocks:
        if blk.q_start < 0 or blk.q_start + blk.q_len > sq or blk.k_start < 0 or blk.k_start + blk.k_len > sk:
            raise ValueError(f"{blk} lies outside q rows [0, {sq}) / k rows [0, {sk})")


def _step_facts(blocks: Sequence[Block]) -> dict | None:
    """What `nonempty`, `any_masked`, `block_area` and `check_rows` ask of a
    `burstcu.layout.StepBlocks`, computed once whole-array (kept in its memo); None for another
    sequence of Blocks (a few, read one by one)."""
    memo = getattr(blocks, "memo", None)
    if memo is None:
        return None
    if "facts" not in memo:
        a = blocks.array
        ends = (a["q_start"] + a["q_len"], a["k_start"] + a["k_len"])
        memo["facts"] = {
            "empty": bool(np.any((a["q_len"] <= 0) | (a["k_len"] <= 0))),
            "masked": bool(np.any(masked_rows(a))),
            "area": int(np.sum(a["q_len"] * a["k_len"])),
            "rows": ((int(a["q_start"].min()), int(ends[0].max()), int(a["k_start"].min()),
                      int(ends[1].max())) if a.size else (0, 0, 0, 0))}
    return memo["facts"]


def _per_step(name: str):
    """Decorator: f(blocks, *args) computed once per `burstcu.layout.StepBlocks` (kept in its
    memo under (name, *args), or name alone), every call for any other sequence of blocks; an
    exception keeps nothing."""
    def wrap(f):
        @functools.wraps(f)
        def kept(blocks, *args):
            memo = getattr(blocks, "memo", None)
            if memo is None:
                return f(blocks, *args)
            key = (name, *args) if args else name
            if key not in memo:
                memo[key] = f(blocks, *args)
            return memo[key]
        return kept
    return wrap


@_per_step("rects")
def block_rects(blocks: Sequence[Block]) -> np.ndarray:
    """(n, 8) int32: the BlockRect of each of `blocks` (`block_rect`; `_rect_columns`
    transposed), whole-array; once per `burstcu.layout.StepBlocks` (kept in its `memo`)."""
    rects = np.ascontiguousarray(_rect_columns(blocks).T, dtype=np.int32)
    rects.flags.writeable = False
    return rects


@_per_step("rect columns")
def _rect_columns(blocks: Sequence[Block]) -> np.ndarray:
    """(8, n) int64: the BlockRect fields (`BLOCK_RECT.names`) of `blocks`, one row a field;
    once per `burstcu.layout.StepBlocks` (kept in its `memo`). ValueError for a position beyond
    `MAX_POSITION` (`key_bounds`) or a value beyond int32 (what the kernels' rectangles hold)."""
    rows = rectangle_rows(blocks)
    cols = np.empty((8, rows.size), np.int64)
    for i, field in enumerate(BLOCK_RECT.names[:6]):            # q_start .. k_pos
        cols[i] = rows[field]
    right, left, hi, lo = rows["right"], rows["left"], cols[6], cols[7]   # as `key_bounds`
    np.minimum(right, NO_BOUND, out=hi)
    hi[right < 0] = NO_BOUND
    hi[rows["causal"]] = 0
    lo[:] = left
    lo[left < 0] = NO_BOUND
    if rows.size:
        _check_reach(int((cols[4:6] + cols[1:4:2]).max()))       # (q_pos, k_pos) + (q_len, k_len)
        if cols.min() < -I32_MAX - 1 or cols.max() > I32_MAX:
            raise ValueError("a rectangle list holds values beyond int32 (the kernels' rectangles)")
    cols.flags.writeable = False
    return cols


def fwd_step_params(q, k, v, acc, m, l, nonfinite, block: Block | None, scale_log2: float,
                    groups: "StepGroups | None" = None, *, out=None, lse=None) -> np.void:
    """FwdStepParams: q (B, Sq, H, D); k, v (B, Sk, Hkv, D) sharing strides; acc (B, Sq, H, D)
    float32; m, l (B, H, Sq) float32 sharing strides; nonfinite a device int32. flash_fwd_step
    takes one `block`; flash_fwd_steps takes a whole step's `groups` (block None); flash_fwd_pass
    one block, acc, m, l None and out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32."""
    passes = out is not None
    return FWD_STEP.pack(
        q=q, k=k, v=v, acc=acc, m=m, l=l, nonfinite=nonfinite,
        q_stride=_shared_strides(3, q), kv_stride=_shared_strides(3, k, v),
        acc_stride=(0, 0, 0) if acc is None else _shared_strides(3, acc),
        ml_stride=(0, 0) if acc is None else _shared_strides(2, m, l),
        blk=(0,) * 8 if block is None else block_rect(block), H=q.shape[2], Hkv=k.shape[2],
        scale_log2=scale_log2, rects=None if groups is None else groups.rects,
        groups=None if groups is None else groups.offsets,
        row_keys=None if groups is None else groups.row_keys,
        n_groups=0 if groups is None else groups.n_groups, out=out, lse=lse,
        out_stride=_shared_strides(3, out) if passes else (0, 0, 0),
        lse_stride=_shared_strides(2, lse) if passes else (0, 0))


@dataclass(frozen=True)
class StepGroups:
    """A ring step's rectangles for one rectangle-list launch (FwdStepParams' / BwdStepParams'
    rects, groups): rects (n, 8) int32 BlockRects grouped by query range (flash_fwd_steps,
    flash_bwd_dq_steps) or by key range (flash_bwd_dkdv_steps), each group's in the step's order;
    offsets (2 n_groups + 2,) int32: each group's first rectangle, then its first tile; tiles: the
    launch's grid.x (every group's tiles). A packed list (`burstcu.ops.cuda.packing`) has one
    rectangle a tile and row_keys (q_end, 2), key_rows (k_end, 2) int32 say which pairs are kept;
    else both are None. rects and offsets are views of one buffer (one upload a call); row_keys
    and key_rows the step's, shared by a call's packed groupings (`step_group_lists`)."""

    rects: Any
    offsets: Any
    n_groups: int
    tiles: int
    row_keys: Any = None
    key_rows: Any = None

    @property
    def packed(self) -> bool:
        """Whether the list is packed: its tiles mask pairs by row_keys / key_rows (so a step
        with no masked pair has some here, and runs the careful pairs where they are asked)."""
        return self.row_keys is not None


# what a rectangle list is grouped by: the Block fields of a group's range (start, length)
GROUP_RANGES = {"query": ("q_start", "q_len"), "key": ("k_start", "k_len")}


def step_groups(xp, blocks: Sequence[Block], block_m: int) -> StepGroups:
    """`blocks` grouped by query range (q_start, q_len), groups in the order of their first
    block and blocks in theirs within a group, as xp arrays (see StepGroups): what one
    flash_fwd_steps launch folds exactly as one flash_fwd_step launch a block would, in order."""
    return step_group_lists(xp, blocks, [("query", block_m)])[0]


def step_group_lists(xp, blocks: Sequence[Block], groupings: Sequence[tuple[str, int]],
                     pack: bool = False) -> tuple[StepGroups, ...]:
    """`blocks` as one StepGroups per (range, tile rows) of `groupings`, range "query" (grouped
    by (q_start, q_len), tiles of that many query rows) or "key" (by (k_start, k_len), tiles of
    keys); groups in the order of their first block, blocks in theirs within a group. With
    `pack`, a grouping that `packing.worth_packing` favours is packed instead (`packed_list`).
    The groupings' rectangles and offsets lie in one buffer, uploaded once; a packed grouping's
    row_keys and key_rows are the step's (`_row_intervals`, kept in its memo), uploaded as they
    are (with NumPy, not copied) and shared by the call's packed groupings; the host side is
    built with whole-array operations. Unpacked, the blocks must be `listable` by every grouping
    (else ValueError: the launch's groups would write the same rows); their values fit in int32
    (`_rect_columns`)."""
    lists = []
    for by, tile_rows in groupings:
        packed = packed_list(blocks, by, tile_rows) if pack else None
        lists.append((packed.host, packed.n_groups, packed.tiles, True) if packed is not None
                     else (*_group_list(blocks, by, tile_rows), False))
    runs = _row_intervals(blocks) if any(listed[3] for listed in lists) else None
    row_keys, key_rows = (None, None) if runs is None else (xp.asarray(runs[0]), xp.asarray(runs[1]))
    buffer = xp.asarray(np.concatenate([listed[0] for listed in lists]))
    at = 0
    out = []
    for host, n_groups, tiles, is_packed in lists:
        rects_end = at + host.size - 2 * n_groups - 2
        out.append(StepGroups(buffer[at:rects_end], buffer[rects_end:at + host.size], n_groups,
                              tiles, *((row_keys, key_rows) if is_packed else ())))
        at += host.size
    return tuple(out)


@_per_step("packed")
def packed_list(blocks: Sequence[Block], by: str, tile_rows: int) -> packing.PackedGroups | None:
    """A packed grouping of `blocks` (`packing.packed_groups`), or None where they cannot be
    packed (`_row_intervals`), keep no pair (a grid of 0 tiles; the rectangle list's tiles do
    nothing) or packing does not pay (`packing.worth_packing`, against the rectangle list's
    tiles). Kept in a StepBlocks' memo (so a change of `packing.PACK_GAIN` holds for steps made
    after it)."""
    runs = _row_intervals(blocks)
    listed = None
    if runs is not None:
        listed = packing.packed_groups(runs[by == "key"], by, tile_rows, NO_BOUND)
        if listed.n_groups == 0 or not packing.worth_packing(_list_tiles(blocks, tile_rows), listed.work):
            listed = None
    return listed


@_per_step("list tiles")
def _list_tiles(blocks: Sequence[Block], tile_rows: int) -> int:
    """`packing.list_tiles` of `blocks` (a grouping by either range counts the same tiles), kept
    in a StepBlocks' memo."""
    return packing.list_tiles(_rect_columns(blocks), tile_rows)


@_per_step("row intervals")
def _row_intervals(blocks: Sequence[Block]) -> tuple[np.ndarray, np.ndarray] | None:
    """`packing.row_intervals` of a list of 2 or more `blocks` (None for one), kept in a
    StepBlocks' memo."""
    return packing.row_intervals(_rect_columns(blocks)) if len(blocks) > 1 else None


@_per_step("list")
def _group_list(blocks: Sequence[Block], by: str, tile_rows: int) -> tuple[np.ndarray, int, int]:
    """One grouping's part of a `step_group_lists` buffer: (host (8 n + 2 g + 2,) int32: the n
    BlockRects (`block_rects`) group by group (`_grouped`), then each of the g groups' first
    rectangle and n, then each group's first tile (of `tile_rows` rows) and the tiles; g; the
    tiles). Kept in a StepBlocks' memo."""
    grouped = _grouped(blocks, by)
    if grouped is None:
        raise ValueError(f"two {by} ranges of one ring step overlap without being equal: a "
                         f"rectangle-list launch needs every two equal or disjoint")
    order, bounds, rows = grouped
    g, m = rows.size, 8 * order.size
    tiles = ((rows + tile_rows - 1) // tile_rows).cumsum()
    total = int(tiles[-1]) if g else 0
    if total > I32_MAX:
        raise ValueError("a rectangle list holds values beyond int32 (the kernels' rectangles)")
    host = np.empty(m + 2 * g + 2, np.int32)
    block_rects(blocks).take(order, axis=0, out=host[:m].reshape(-1, 8), mode="clip")   # in range
    host[m:m + g + 1], host[m + g + 1], host[m + g + 2:] = bounds, 0, tiles
    host.flags.writeable = False
    return host, g, total


def listable(blocks: Sequence[Block], groupings: Sequence[str]) -> bool:
    """Whether one list launch can take `blocks` grouped by each of `groupings` ("query",
    "key"): every two blocks' ranges equal or disjoint (`burstcu.layout.blocks` makes them so;
    other lists run a launch a block). ValueError as `_rect_columns`."""
    return all(_grouped(blocks, by) is not None for by in groupings)


@_per_step("grouped")
def _grouped(blocks: Sequence[Block], by: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`blocks` grouped by their `by` range ("query": (q_start, q_len), "key": (k_start,
    k_len)), groups in the order of their first block: (order (n,) the block indices group by
    group, each group's in the blocks' order; bounds (g + 1,) each group's first index into
    order, then n; rows (g,) int64 a group's range length), or None where two distinct ranges
    overlap. Kept in a StepBlocks' memo. Blocks whose ranges already come in ascending order (as
    `burstcu.layout.rectangles` lists a causal step's, by query and by key range) need no sort."""
    cols = _rect_columns(blocks)
    column = BLOCK_RECT.names.index(GROUP_RANGES[by][0])
    start, length = cols[column], cols[column + 1]
    key = (start << 32) + length + 2**31        # ordered as (start, length) are (both int32)
    by_range = _range_order(key)                # the blocks by (start, length), then index
    if by_range is not None:
        key = key[by_range]
    new = np.ones(key.size + 1, bool)           # where a range starts, and the end
    np.not_equal(key[1:], key[:-1], out=new[1:-1])
    bounds = new.nonzero()[0]
    first = bounds[:-1] if by_range is None else by_range[bounds[:-1]]   # each range's first block
    range_start, range_rows = start[first], length[first]
    grouped = None
    if not (range_start[1:] < range_start[:-1] + range_rows[:-1]).any():   # equal or disjoint
        if by_range is None:
            grouped = (np.arange(key.size), bounds, range_rows)
        else:                                   # the ranges in the order of their first block
            in_order = first.argsort()
            counts = np.diff(bounds)[in_order]
            order = by_range[ragged(bounds[:-1][in_order], counts)[1]]
            grouped = (order, np.concatenate([[0], np.cumsum(counts)]), range_rows[in_order])
    return grouped


def _range_order(key: np.ndarray) -> np.ndarray | None:
    """The stable order that sorts `key` (n,), or None where it is sorted already: no sort."""
    return key.argsort(kind="stable") if (key[1:] < key[:-1]).any() else None


def fwd_step_sm90_params(q_map, k_map, v_map, acc, m, l, nonfinite, block: Block | None, heads: int,
                         kv_heads: int, scale_log2: float, n_tiles: int, hb_group: int,
                         groups: StepGroups | None = None, *, fresh: bool = False, out=None,
                         lse=None) -> np.void:
    """FwdStepSm90Params: the tensor maps of q's and k's, v's rows in the block (128 uint8 each,
    `burstcu.ops.cuda.tensor_map`); acc (B, Sq, H, D) float32; m, l (B, H, Sq) float32 sharing
    strides; nonfinite a device int32; n_tiles the query tiles x H x B of the launch; hb_group
    the (batch, head) pairs whose tiles the grid takes together (1 .. H x B).
    flash_fwd_steps_sm90 takes a whole step's `groups` (block None) and maps of whole arrays.
    A block over every query row may start from a `fresh` state (not read) and, given out
    (B, Sq, H, D) in q's dtype and lse (B, H, Sq) float32, end the pass (finalize: those are
    written, the state is not); with both, acc, m and l may be None (null pointers)."""
    finalize = out is not None
    assert acc is not None or (fresh and finalize), "a fold that reads or writes the state needs it"
    return FWD_STEP_SM90.pack(
        q_map=q_map, k_map=k_map, v_map=v_map, acc=acc, m=m, l=l, nonfinite=nonfinite,
        acc_stride=(0, 0, 0) if acc is None else _shared_strides(3, acc),
        ml_stride=(0, 0) if acc is None else _shared_strides(2, m, l),
        blk=(0,) * 8 if block is None else block_rect(block), H=heads, Hkv=kv_heads,
        scale_log2=scale_log2, n_tiles=n_tiles, hb_group=hb_group,
        n_groups=0 if groups is None else groups.n_groups,
        rects=None if groups is None else groups.rects,
        groups=None if groups is None else groups.offsets,
        row_keys=None if groups is None else groups.row_keys,
        out=out, lse=lse, out_stride=_shared_strides(3, out) if finalize else (0, 0, 0),
        lse_stride=_shared_strides(2, lse) if finalize else (0, 0), fresh=int(fresh),
        finalize=int(finalize))


def fwd_finalize_params(acc, m, l, out, lse, vec: int) -> np.void:
    """FwdFinalizeParams: acc (B, S, H, D) float32, m, l (B, H, S) float32 sharing strides,
    out (B, S, H, D), lse (B, H, S) float32; vec elements a thread (8 or 1)."""
    return FWD_FINALIZE.pack(
        acc=acc, m=m, l=l, out=out, lse=lse, acc_stride=_shared_strides(3, acc),
        out_stride=_shared_strides(3, out), ml_stride=_shared_strides(2, m, l),
        lse_stride=_shared_strides(2, lse), S=acc.shape[1], D=acc.shape[3], vec=vec)


def nonfinite_params(x, flag, vec: int) -> np.void:
    """NonfiniteParams: x (B, S, H, D) with a contiguous last dim, flag a device int32."""
    return NONFINITE.pack(x=x, flag=flag, x_stride=_shared_strides(3, x), S=x.shape[1],
                          D=x.shape[3], vec=vec)


def bwd_delta_params(out, dout, delta) -> np.void:
    """BwdDeltaParams: out, dout (B, S, H, D) sharing strides, delta (B, H, S) float32."""
    B, S, H, D = dout.shape
    return BWD_DELTA.pack(out=out, dout=dout, delta=delta,
                          row_stride=_shared_strides(3, out, dout),
                          delta_stride=_shared_strides(2, delta), B=B, S=S, H=H, D=D)


def bwd_step_params(q, dout, k, v, lse, delta, dq, dk, dv, psum, nonfinite, block: Block | None,
                    scale: float, groups: StepGroups | None = None) -> np.void:
    """BwdStepParams: q, dout (B, Sq, H, D) sharing strides; k, v (B, Sk, Hkv, D) sharing
    strides; lse, delta (and psum unless None) (B, H, Sq) float32 sharing strides; dq (B, Sq, H,
    D) float32; dk, dv (B, Sk, Hkv, D) float32 sharing strides; nonfinite a device int32.
    flash_bwd_dkdv / flash_bwd_dq take one `block`; their _steps twins a whole step's `groups`
    (`step_group_lists`: by key range for dK/dV, by query range for dQ; block None)."""
    stats = (lse, delta) if psum is None else (lse, delta, psum)
    return BWD_STEP.pack(
        q=q, dout=dout, k=k, v=v, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv, psum=psum,
        nonfinite=nonfinite, q_stride=_shared_strides(3, q, dout),
        k_stride=_shared_strides(3, k, v), dq_stride=_shared_strides(3, dq),
        dk_stride=_shared_strides(3, dk, dv), stat_stride=_shared_strides(2, *stats),
        blk=(0,) * 8 if block is None else block_rect(block), H=q.shape[2], Hkv=k.shape[2],
        scale=scale, rects=None if groups is None else groups.rects,
        groups=None if groups is None else groups.offsets,
        row_keys=None if groups is None else groups.row_keys,
        key_rows=None if groups is None else groups.key_rows,
        n_groups=0 if groups is None else groups.n_groups)


def bwd_step_sm90_params(maps: tuple, lse, delta, dq, dk, dv, nonfinite, block: Block | None,
                         heads: int, kv_heads: int, scale: float,
                         groups: StepGroups | None = None, dq_adds: int = 1) -> np.void:
    """BwdStepSm90Params: `maps` the tensor maps (q, dO, k, v, and dq or None) of the block's rows
    (128 uint8 each, `burstcu.ops.cuda.tensor_map`); lse, delta (B, H, Sq) float32 sharing
    strides, rows contiguous; dq (B, Sq, H, D) float32; dk, dv (B, Sk, Hkv, D) float32 sharing
    strides; nonfinite a device int32. flash_bwd_dkdv_steps_sm90 takes a whole step's `groups`
    (grouped by key range; block None) and maps of the whole arrays. `dq_adds`: how the kernel
    adds dQ (kernels/params.cuh: 1 one float an atomic add, 2 two, 3 bulk reductions through the
    dq map); 2 and 3 need dq's rows on 16 bytes (`rows_on_16_bytes`)."""
    q_map, do_map, k_map, v_map, dq_map = maps
    if dq_adds == 3 and dq_map is None:
        raise ValueError("dq_adds 3 (bulk reductions) needs dq's tensor map")
    return BWD_STEP_SM90.pack(
        q_map=q_map, do_map=do_map, k_map=k_map, v_map=v_map,
        dq_map=np.zeros(128, np.uint8) if dq_map is None else dq_map, lse=lse, delta=delta, dq=dq, dk=dk,
        dv=dv, nonfinite=nonfinite, dq_stride=_shared_strides(3, dq),
        dk_stride=_shared_strides(3, dk, dv), stat_stride=_shared_strides(2, lse, delta),
        blk=(0,) * 8 if block is None else block_rect(block), H=heads, Hkv=kv_heads, scale=scale,
        n_groups=0 if groups is None else groups.n_groups,
        rects=None if groups is None else groups.rects,
        groups=None if groups is None else groups.offsets,
        key_rows=None if groups is None else groups.key_rows,
        dq_adds=dq_adds)
