"""`python -m burstcu.selftest`: check this installation on whatever hardware is present.

    python -m burstcu.selftest [--quick] [--json PATH]
    mpiexec -n 4 python -m burstcu.selftest           # every rank checks its own shard

Three checks, on the CPU backend (NumPy over MPI) always, and on the GPU backend (CUDA kernels
over NCCL) when a GPU is usable:

1. correctness: forward and backward against the float64 reference of `burstcu.testing.reference`
   (full score matrix), every rank's rows, in two cases (`correctness_cases`): a small causal
   zigzag problem in the op's native dtype, and full attention in its working dtype (float32; the
   kernels' float16) over shards of several tiles, the last one ragged;
2. bandwidth: one ring exchange (send to next, receive from prev) of growing messages through
   the transport, host-timed to completion (a device sync on the GPU);
3. overlap: one ring step's compute alone, its exchange alone, and both as the engine issues them.
   overlap = (compute + comm - both) / comm: the fraction of the exchange hidden behind compute
   (1: fully hidden; 0: back to back), ± its uncertainty: the jitter of the three timings (their
   ranges over the repeats, added) over the exchange's time. Reported only when it is a
   measurement, its uncertainty below MEASURABLE (0.15, the rule bench/cpu/overlap.py applies
   too); otherwise the line says it is not measurable here, with the numbers, instead of
   printing one (on one machine the exchange through shared memory is often shorter than the
   timings' jitter). A figure below zero by more than its uncertainty says what that means.

Rank 0 prints one line per check; the exit status is 1 when a correctness check fails or a GPU
found here cannot be started. `--full` exits 1 when a check fails, and 2, saying NOTHING
CHECKED, when every check it ran was skipped (`--full --only nccl` without a GPU). Timings are
what this machine measured; nothing here is a claim about other hardware.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from . import api
from .group import Group, init, on_gpu
from .transport.bootstrap import BackendUnavailable, agreed_arguments, gpu_usable, world_comm
from .layout import step_blocks
from .ops.numpy import blas_advice
from .testing.reference import attention_backward_ref, attention_ref
from .transport.base import resolve_timeout
from .transport.mpi import gather_plain

# an overlap figure (the fraction of the exchange hidden) is printed only when its uncertainty,
# in the same unit, is below this: at 0.15 "0.5" could be anything from a third to two thirds hidden
MEASURABLE = 0.15
NEGATIVE = ("negative beyond its uncertainty: compute and exchange together took longer than one "
            "after the other, cores contended")

NOTHING_CHECKED = 2   # --full's exit status when every check it ran was skipped (as burstcu.build)

# max abs error allowed against float64 on unit-normal inputs of this size: float64/float32 a few
# hundred ulps; float16 (the CUDA kernels: fp16 operands, fp32 accumulation) ~10 ulps of 1
TOL = {"float64": 1e-9, "float32": 2e-4, "float16": 1e-2}


def native_dtype(group: Group) -> str:
    """The dtype this group's local op computes natively: the CUDA kernels take float16."""
    return "float16" if "float16" in group.ops.dtypes and "float32" not in group.ops.dtypes else "float64"


# ----------------------------------------------------------------------------------------------
# correctness

def _reference(q, k, v, dout, causal: bool):
    """float64 out and (dq, dk, dv) over the whole sequence (`burstcu.testing.reference`).
    q: (B, N, H, D); k, v: (B, N, Hkv, D)."""
    out, _ = attention_ref(q, k, v, causal)
    return (out, *attention_backward_ref(dout, q, k, v, causal))


def correctness_cases(group: Group) -> list[tuple[dict, dict]]:
    """(options of a group made for the case, `check_correctness` keywords) of each case: the
    native dtype, causal zigzag, 32 rows a rank; then full attention over shards of several tiles
    with a ragged last one (the NumPy op with 16 x 32 tiles in float32; the kernels' own tiles of
    64 or 128 rows in float16)."""
    native = native_dtype(group)
    full = dict(causal=False, layout="contiguous")
    if native == "float64":   # the NumPy op
        tiled = ({"tile_q": 16, "tile_k": 32}, dict(dtype="float32", seqlen_local=80, **full))
    else:
        tiled = ({}, dict(dtype=native, seqlen_local=160, **full))
    return [({}, dict(dtype=native, seqlen_local=32, causal=True, layout="zigzag")), tiled]


def check_correctness(group: Group, xp: Any = np, dtype: str = "float64", seqlen_local: int = 32,
                      causal: bool = True, layout: str = "zigzag") -> dict:
    """Max abs error of this rank's out, dq, dk, dv against `_reference`; ok when all < TOL."""
    n = seqlen_local * group.size
    rng = np.random.default_rng(1234)
    q, dout = (rng.standard_normal((1, n, 4, 32)) for _ in range(2))
    k, v = (rng.standard_normal((1, n, 2, 32)) for _ in range(2))
    ref = _reference(q, k, v, dout, causal)
    local = [xp.asarray(api.shard(x.astype(dtype), group, layout)) for x in (q, k, v, dout)]
    out, lse = api.attention(*local[:3], group, causal=causal, layout=layout, return_lse=True)
    grads = api.attention_backward(local[3], *local[:3], out, lse, group, causal=causal, layout=layout)
    errors = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
        got = got.get() if hasattr(got, "get") else got
        errors[name] = float(np.abs(got.astype(np.float64) - api.shard(want, group, layout)).max())
    return {"ok": all(e < TOL[dtype] for e in errors.values()), "errors": errors,
            "case": f"{dtype}, {'causal ' if causal else 'full, '}{layout}, {seqlen_local} rows a rank"}


# ----------------------------------------------------------------------------------------------
# timing

def _seconds(fn, sync, repeat: int) -> list[float]:
    fn()
    sync()  # warm-up: allocations, NCCL connection setup
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _median_seconds(fn, sync, repeat: int) -> float:
    return float(np.median(_seconds(fn, sync, repeat)))


def _exchange(group: Group, send, recv) -> None:
    t = group.transport
    t.send_recv(send, recv, t.next_rank, t.prev_rank)
    t.commit()
    t.wait()


def probe_bandwidth(group: Group, sizes=(1 << 16, 1 << 20, 1 << 22), repeat: int = 5) -> list[dict]:
    """One ring exchange per message size: seconds and GB/s sent per rank (empty for one rank)."""
    if group.size == 1:
        return []
    xp = group.ops.xp
    rows = []
    for nbytes in sizes:
        send, recv = xp.ones(nbytes, dtype=np.uint8), xp.empty(nbytes, dtype=np.uint8)
        group.barrier()
        seconds = _median_seconds(lambda: _exchange(group, send, recv), group.ops.sync, repeat)
        rows.append({"bytes": nbytes, "seconds": seconds, "GB/s": nbytes / seconds / 1e9})
    return rows


def probe_overlap(group: Group, seqlen: int = 512, heads: int = 8, headdim: int = 64,
                  repeat: int = 5, dtype: str = "float32") -> dict:
    """One ring step: compute alone, exchange alone, and both as the engine overlaps them."""
    ops, xp = group.ops, group.ops.xp
    shape_kv = (1, seqlen, heads, headdim)
    q = xp.ones((1, seqlen, heads, headdim), dtype=dtype)
    k, v = xp.ones(shape_kv, dtype=dtype), xp.ones(shape_kv, dtype=dtype)
    fields = [("k", shape_kv, dtype), ("v", shape_kv, dtype)]
    cur, nxt = ops.message(fields), ops.message(fields)
    ops.copy_(cur["k"], k)
    ops.copy_(cur["v"], v)
    state = ops.forward_init(q, 1.0 / math.sqrt(headdim))
    blocks = step_blocks("contiguous", 0, 0, 1, seqlen, False)
    compute = lambda: ops.forward_step(state, cur["k"], cur["v"], blocks)  # noqa: E731
    times = {"compute": _seconds(compute, ops.sync, repeat)}
    result = {"compute_s": float(np.median(times["compute"])), "message_bytes": 2 * k.nbytes}
    if group.size == 1:
        return result
    span_c, span_n = cur.span("k", "v"), nxt.span("k", "v")
    t = group.transport

    def both():
        t.send_recv(span_c, span_n, t.next_rank, t.prev_rank)
        t.commit()
        compute()
        t.wait()

    group.barrier()
    times["comm"] = _seconds(lambda: _exchange(group, span_c, span_n), ops.sync, repeat)
    group.barrier()
    times["both"] = _seconds(both, ops.sync, repeat)
    result["comm_s"], result["both_s"] = (float(np.median(times[k])) for k in ("comm", "both"))
    result.update(overlap_figures(result["compute_s"], result["comm_s"], result["both_s"],
                                  sum(max(x) - min(x) for x in times.values())))
    return result


def judge_overlap(raw: float | None, uncertainty: float, source: str, comm_s: float
                  ) -> tuple[float | None, str | None]:
    """The one rule for printing an overlap figure (here and in bench/cpu/overlap.py).

    raw: (compute + comm - both) / comm, the fraction of the exchange hidden (None: no exchange);
    uncertainty: its uncertainty, the same unit; source: where that comes from, for the note
    ("the spread over 3 repeats"); comm_s: the exchange's seconds.
    Returns (figure, note): the figure only when uncertainty < MEASURABLE, else None and a note
    "not measurable here (...)" with the numbers; a figure negative beyond its uncertainty
    (raw + uncertainty < 0) comes with NEGATIVE, one within it of zero with no note."""
    if raw is None:
        return None, "no exchange"
    if not uncertainty < MEASURABLE:
        return None, (f"not measurable here (±{uncertainty:.2f} from {source}, a measurement needs "
                      f"< {MEASURABLE}; exchange {comm_s * 1e3:.2f} ms)")
    return raw, NEGATIVE if raw + uncertainty < 0 else None


def overlap_figures(compute_s: float, comm_s: float, both_s: float, jitter_s: float) -> dict:
    """overlap = (compute + comm - both) / comm (all seconds) and its uncertainty jitter_s /
    comm_s (jitter_s: the three timings' ranges over the repeats, added), judged by
    `judge_overlap`: the figure (None unless a measurement), the raw one, and the note."""
    raw = (compute_s + comm_s - both_s) / comm_s if comm_s > 0 else None
    uncertainty = jitter_s / comm_s if comm_s > 0 else math.inf
    figure, note = judge_overlap(raw, uncertainty, f"a timing jitter of {jitter_s * 1e3:.2f} ms, the "
                                                   f"three timings' ranges added", comm_s)
    return {"overlap_raw": raw, "overlap": figure, "overlap_uncertainty": uncertainty,
            "jitter_s": jitter_s, "overlap_note": note}


# ----------------------------------------------------------------------------------------------
# the report

def run_backend(backend: str, quick: bool) -> dict:
    """All three checks on one backend; every rank returns its own results."""
    with init(backend=backend) as group:
        xp = group.ops.xp
        report: dict = {"backend": backend, "transport": group.transport.name, "size": group.size}
        dtype = native_dtype(group)
        report["correctness"] = []
        for options, case in correctness_cases(group):   # a group of its own: collective
            with init(backend=backend, **options) if options else nullcontext(group) as own:
                report["correctness"].append(check_correctness(own, xp, **case))
        sizes = (1 << 16, 1 << 20) if quick else (1 << 16, 1 << 20, 1 << 22, 1 << 24)
        report["bandwidth"] = probe_bandwidth(group, sizes, repeat=3 if quick else 10)
        report["overlap"] = probe_overlap(group, seqlen=128 if quick else 1024, repeat=3 if quick else 10,
                                          dtype="float32" if dtype == "float64" else dtype)
    return report


def _lines(reports_by_rank: list[dict]) -> list[str]:
    first = reports_by_rank[0]
    head = f"[{first['backend']} over {first['transport']}, {first['size']} rank(s)]"
    lines = []
    for i, case in enumerate(first["correctness"]):
        bad = [r for r, rep in enumerate(reports_by_rank) if not rep["correctness"][i]["ok"]]
        worst = {k: max(rep["correctness"][i]["errors"][k] for rep in reports_by_rank)
                 for k in case["errors"]}
        lines.append(f"{head} correctness: {'FAIL on ranks ' + str(bad) if bad else 'ok'} ({case['case']}; "
                     f"max abs error " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()) + ")")
    for row in first["bandwidth"]:
        lines.append(f"{head} ring exchange {row['bytes']:>9d} B: {row['seconds'] * 1e6:9.1f} us, "
                     f"{row['GB/s']:.3f} GB/s per rank (rank 0)")
    if not first["bandwidth"]:
        lines.append(f"{head} bandwidth: one rank, no peer to exchange with")
    lines.append(_overlap_line(head, first["overlap"]))
    return lines


def _overlap_line(head: str, ov: dict) -> str:
    """The overlap check's line: a figure only when it is a measurement (`judge_overlap`), one
    negative beyond its uncertainty with what it means."""
    text = f"{head} one ring step: compute {ov['compute_s'] * 1e3:.2f} ms"
    if "comm_s" in ov:
        text += f", exchange {ov['comm_s'] * 1e3:.2f} ms, both {ov['both_s'] * 1e3:.2f} ms, overlap "
        if ov["overlap"] is None:
            text += ov["overlap_note"]
        else:
            text += f"{ov['overlap']:.2f}±{ov['overlap_uncertainty']:.2f} (1 = exchange fully hidden"
            text += f"; {ov['overlap_note']})" if ov["overlap_note"] else ")"
    return text + " (rank 0; timings, not a check: they do not decide PASSED)"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m burstcu.selftest", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (CI smoke)")
    parser.add_argument("--json", help="write every rank's results to this file (rank 0)")
    parser.add_argument("--full", action="store_true",
                        help="everything one device can check (burstcu.testing.checks): on a GPU "
                             "at full sizes, else the kernels on the CPU emulator at toy sizes")
    parser.add_argument("--only", nargs="+", metavar="CHECK",
                        choices=["variants", "kernels", "ring_steps", "nccl", "determinism", "loopback"],
                        help="with --full: run only these checks (variants, kernels, ring_steps, "
                             "nccl, determinism, loopback)")
    args = parser.parse_args(argv)
    if args.only and not args.full:
        parser.error("--only chooses among --full's checks: pass --full too")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        parser.error(f"--json {args.json}: not a file in an existing folder")   # before any check
    return args


def main(argv=None) -> int:
    # every rank runs the same checks and gathers their results (rank 0 alone writes --json)
    args, status = agreed_arguments(parse, argv, "burstcu selftest", ignore=("json",))
    if args is None:
        return status
    if args.full:
        return run_full(args)

    # decided together: a rank alone on the GPU path would wait forever for the others
    gpu = all(_gather(gpu_usable()))
    results, ok, lines = {}, True, []
    for backend in ["numpy"] + (["cupy"] if gpu else []):
        try:
            mine = run_backend(backend, args.quick)
        except BackendUnavailable as exc:  # raised on every rank alike (agreed in bootstrap)
            lines.append(f"[{backend}] cannot start on the GPU found here: {exc}")
            ok = False
            continue
        everyone = _gather(mine)
        results[backend] = everyone
        ok &= all(case["ok"] for rep in everyone for case in rep["correctness"])
        lines += _lines(everyone)
    if _rank() == 0:
        if not gpu:
            lines.insert(0, "no usable CUDA GPU on this machine: ran the CPU checks only")
        advice = blas_advice()
        if advice:
            lines.append(f"[numpy] {advice}")
        print("\n".join(lines + [f"selftest {'PASSED' if ok else 'FAILED'}"]), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=1)
    return 0 if ok else 1


def run_full(args) -> int:
    """`--full`: one process, one device. On a GPU every check at full size; without one, the
    same checks through the kernel emulator at toy sizes (what CI runs). 1 if a check failed,
    NOTHING_CHECKED if every check run was skipped (`--only nccl` without a GPU), else 0."""
    from .testing import checks

    if len(_gather(None)) > 1:
        if _rank() == 0:
            print("selftest --full checks one device from one process: run it without mpiexec "
                  "(it starts its own ranks as threads on the device)", flush=True)
        return 2
    backend = "cupy" if gpu_usable() else "emulated"
    quick = args.quick or not on_gpu(backend)
    started = time.perf_counter()
    records = checks.run_all(backend, quick, args.only, progress=_progress)
    failed = [r for r in records if r["passed"] is False]
    skipped = [r for r in records if r["passed"] is None]
    for r in records:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[r["passed"]]
        detail = r["detail"] if isinstance(r["detail"], str) else _short(r["detail"])
        print(f"{mark} {r['name']}: {detail}", flush=True)
    passed, seconds = len(records) - len(failed) - len(skipped), time.perf_counter() - started
    summary = (f"selftest --full on {checks.device_name(backend)}: {passed} passed, {len(failed)} "
               f"failed, {len(skipped)} skipped in {seconds:.0f} s")
    verdict = " - FAILED" if failed else " - PASSED" if passed else \
        " - NOTHING CHECKED: every check run was skipped (what it needs is missing here)"
    print(summary + verdict, flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": checks.device_name(backend), "backend": backend, "quick": quick,
                       "versions": checks.versions(), "summary": summary, "checks": records},
                      fh, indent=1, default=str)
    return 1 if failed else 0 if passed else NOTHING_CHECKED


def _short(detail: Any) -> str:
    """A one-line digest of a check's detail dict (the JSON keeps all of it)."""
    if not isinstance(detail, dict):
        return str(detail)
    parts = []
    for key, value in detail.items():
        if key == "kernels":
            regs = [k.get("registers") for k in value if k.get("registers") is not None]
            parts.append(f"registers {min(regs)}-{max(regs)}" if regs else "")
        elif isinstance(value, list):
            parts.append(f"{key} {len(value)}")
        else:
            parts.append(f"{key} {value}")
    return "; ".join(p for p in parts if p)


def _progress(message: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _comm():
    return world_comm()


def _rank() -> int:
    comm = _comm()
    return 0 if comm is None else comm.Get_rank()


def _gather(obj) -> list:
    """Every rank's `obj` (plain values), bounded by $BURSTCU_TIMEOUT (else 600 s)."""
    comm = _comm()
    return [obj] if comm is None else gather_plain(comm, obj, resolve_timeout(None), "the self-test")


if __name__ == "__main__":
    sys.exit(main())
