"""The main job: exact attention over a sequence split across `mpiexec -n G` ranks, checked.

    mpiexec -n 4 python -m burstcu.demo [--seqlen 4096] [--heads 8] [--kv-heads 8] [--headdim 64]
                                        [--causal] [--layout zigzag] [--backend auto]
                                        [--sample-rows 256] [--no-check]

Every rank builds the same global Q, K, V, dO from a seed, keeps its shard, and runs the forward
and backward passes of BurstAttention (strategy "burst": K and V travel the ring together) twice:
one untimed warm-up pass, so that the times exclude the kernel backends' one-time compiles (NVRTC,
or g++ for the emulator) and other first-call costs, then the timed pass.

Then each rank checks its out, dq, dk, dv against an independent reference
(`burstcu.testing.reference`: full score matrix, explicit softmax, written without burstcu) in
float64 (long double for float64 inputs), at a sample of its rows: the first and last row of each
contiguous piece of its shard (so every shard boundary and the sequence's first and last rows) and
one random row in every stretch of seqlen / sample_rows rows (random from a fixed seed: the same
rows on every run). out and dq are checked there on every batch row and head. dk and dv of a key
row sum over every query row that sees it, each weighted by its softmax statistics (lse, delta),
so their reference needs a forward pass over every row: it runs for CHECKED_KV_HEADS random kv
heads (and their query heads) only, which also checks out at every row of those heads, and each
rank adds its query rows' share of dk, dv at every rank's sampled rows (an allreduce).

The rule is FlashAttention's: err = max |x - ref| over the checked entries of x = out, dq, dk, dv
must be at most 2 x the error of a naive implementation in the inputs' precision (the same
reference code run in float32, P and the results rounded to a half-precision input's dtype) +
8 eps max |ref| (the largest over every rank's rows: a rank's piece of a result, a causal first
row's dq of ~0, is rounded at the scale of the whole). Ranks agree on the verdict: rank 0 prints
the per-rank table of errors, times and bytes, the byte formula of `burstcu.engine.burst`, then
one line per rank, PASSED or FAILED with the quantity nearest its bound; every rank returns 1 if
any rank FAILED, else 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import burstcu
from burstcu.engine import burst
from burstcu.layout import partition
from burstcu.ops.base import as_dtype, finfo
from burstcu.testing.reference import (attention_ref, largest_finite, max_err, step_backward_ref,
                                       within_fa_rule)
from burstcu.transport.base import CommTimeoutError, deadline_after, poll_until
from burstcu.transport.bootstrap import BackendUnavailable, agreed_arguments, world_comm

FA_FACTOR = 2.0             # FlashAttention's tests: at most twice the naive implementation's error
BLOCK_ELEMENTS = 1 << 22    # scores per reference row block (32 MiB in float64)
CHECKED_KV_HEADS = 2        # kv heads whose dk, dv are checked: their reference costs a forward
                            # pass over every row (of their query heads)
SAMPLE_SEED = 7             # of the sampled rows and heads: the same on every run
QUANTITIES = ("out", "dq", "dk", "dv")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def writable_file(path: str) -> bool:
    """Whether this user can write `path` (a command line's --json, checked before the run, not
    after it): a file (or /dev/null, ...) that exists and is writable, or a new file, its name
    not ending in a path separator, in an existing folder this user can write to."""
    if os.path.exists(path):
        return not os.path.isdir(path) and os.access(path, os.W_OK)
    folder = os.path.dirname(os.path.abspath(path))
    return not path.endswith(os.sep) and os.path.isdir(folder) and os.access(folder, os.W_OK)


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m burstcu.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=positive_int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--kv-heads", type=positive_int, default=None, help="default: --heads (MHA)")
    p.add_argument("--headdim", type=positive_int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "float16", "bfloat16"],
                   help="default: float32 on the NumPy backend, float16 on the CUDA-kernel backends")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "emulated", "cupy"])
    p.add_argument("--sample-rows", type=positive_int, default=256,
                   help="about how many rows of the sequence are checked, besides the shard edges "
                        "(the sequence length: every row)")
    p.add_argument("--no-check", action="store_true", help="skip the reference check")
    args = p.parse_args(argv)
    if args.kv_heads is not None and args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (GQA)")
    return args


def main(argv=None) -> int:
    """Run the job; 0 if every rank PASSED (or --no-check), 1 if any rank FAILED."""
    args, status = agreed_arguments(parse, argv, "burstcu demo")
    if args is None:
        return status
    try:
        group = burstcu.init(backend=args.backend)
    except BackendUnavailable as exc:   # raised on every rank alike (agreed in the bootstrap)
        return _refused(f"--backend {args.backend}: {exc}")
    rank, size = group.rank, group.size
    if args.dtype is None:  # the kernels take half precision; NumPy computes any float
        args.dtype = "float32" if "float32" in group.ops.dtypes else "float16"
    if args.dtype not in group.ops.dtypes:
        group.close()
        return _refused(f"--dtype {args.dtype}: the {group.backend} backend computes "
                        f"{', '.join(group.ops.dtypes)}")
    inputs = _inputs(args)
    xp = group.ops.xp
    try:   # the same arguments on every rank (agreed above), so every rank refuses alike
        ql, kl, vl, dol = (xp.asarray(burstcu.shard(x, group, args.layout)) for x in inputs)
    except ValueError as exc:
        group.close()
        return _refused(f"--seqlen {args.seqlen} on {size} ranks: {exc}")
    if rank == 0:
        _describe(args, group)

    try:   # warm-up, untimed: compiles every kernel it needs
        _passes(group, args, ql, kl, vl, dol)
    except (ValueError, TypeError, MemoryError) as exc:
        if not getattr(exc, "burstcu_agreed", False):   # not raised on every rank alike
            raise
        group.close()   # every rank refuses: these arguments are beyond this backend
        return _refused(f"the {group.backend} backend: {exc}")
    row = {"rank": rank}
    out, _, grads = _passes(group, args, ql, kl, vl, dol, timings=row)
    if not args.no_check:
        say = _progress if rank == 0 else (lambda message: None)
        say(f"burstcu demo: passes done; checking against a {_precision(args.dtype)[0].__name__} "
            f"reference (--no-check skips it); rank 0's progress:")
        got = [_host(x) for x in (out, *grads)]
        row["checks"] = check(group, args, inputs, dict(zip(QUANTITIES, got)), say)
    rows_all = group.transport.allgather_object(row, "demo report")  # every rank sees every verdict
    if rank == 0:
        _report(args, size, rows_all, ql, kl)
    group.close()
    failed = any(not ok for r in rows_all for ok, *_ in r.get("checks", {}).values())
    return 1 if failed else 0


def _refused(message: str) -> int:
    """Exit status 2 for arguments this run cannot take, found alike on every rank after the
    start: rank 0 says why (on stderr)."""
    comm = world_comm()
    if comm is None or comm.Get_rank() == 0:
        print(f"burstcu demo: {message}", file=sys.stderr, flush=True)
    return 2


def _inputs(args):
    """The global q, dout (B, N, H, D) and k, v (B, N, Hkv, D), the same on every rank."""
    dtype = as_dtype(args.dtype)
    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.headdim)
    shape_kv = (args.batch, args.seqlen, args.kv_heads or args.heads, args.headdim)
    q, dout = (rng.standard_normal(shape_q).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    return q, k, v, dout


def _passes(group, args, ql, kl, vl, dol, timings=None):
    """One forward and one backward pass over this rank's shards: (out, lse, (dq, dk, dv)).

    Stores into `timings` (a dict, if given) each pass's wall time (synchronized with the
    device) and this rank's bytes and messages sent: fwd_s, fwd_bytes, fwd_msgs, bwd_s, ...
    """
    timings = {} if timings is None else timings
    group.barrier()
    group.stats.reset()
    t0 = time.perf_counter()
    out, lse = burstcu.attention(ql, kl, vl, group, causal=args.causal, layout=args.layout, return_lse=True)
    group.ops.sync()
    timings["fwd_s"] = time.perf_counter() - t0
    _take_stats(group, timings, "fwd")
    t0 = time.perf_counter()
    grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=args.causal, layout=args.layout)
    group.ops.sync()
    timings["bwd_s"] = time.perf_counter() - t0
    _take_stats(group, timings, "bwd")
    return out, lse, grads


def _take_stats(group, timings: dict, prefix: str) -> None:
    stats = group.stats.as_dict()
    timings[f"{prefix}_bytes"], timings[f"{prefix}_msgs"] = stats["bytes_sent"], stats["messages"]
    group.stats.reset()


def _host(x) -> np.ndarray:
    """A result as a NumPy array (CuPy arrays copied from the device)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


# ------------------------------------------------------------------------------------------------
# the check against the reference

def _precision(dtype_name: str):
    """(reference dtype, naive dtype, round_to, eps) for inputs of `dtype_name`: the naive
    implementation of FlashAttention's rule computes in float32 and rounds P and its results to a
    half-precision input's dtype; float64 inputs get a float64 naive one and a long double
    reference."""
    dtype = as_dtype(dtype_name)
    eps = float(finfo(dtype).eps)
    if dtype == np.float64:
        return np.longdouble, np.float64, None, eps
    return np.float64, np.float32, (dtype if dtype.itemsize < 4 else None), eps


def sample_stride(seqlen: int, sample_rows: int) -> int:
    """Rows per random pick, for about `sample_rows` picks over the sequence (1: every row)."""
    return max(1, math.ceil(seqlen / max(1, sample_rows)))


def sampled_rows(positions: np.ndarray, stride: int, rank: int) -> np.ndarray:
    """Local indices of the rows where `rank` checks every head, ascending: the first and last
    row of each contiguous run of its global `positions` (shard boundaries, and the sequence's
    first and last rows) and one random row (from SAMPLE_SEED and `rank`) in each `stride` local
    rows."""
    positions = np.asarray(positions)
    breaks = np.flatnonzero(np.diff(positions) != 1)
    edges = np.concatenate([[0], breaks, breaks + 1, [len(positions) - 1]])
    rng = np.random.default_rng([SAMPLE_SEED, rank])
    starts = np.arange(0, len(positions), stride)
    picks = starts + rng.integers(0, np.minimum(stride, len(positions) - starts))
    return np.unique(np.concatenate([edges, picks])).astype(np.int64)


def _visible(q_positions, k_positions, causal: bool):
    """The (Sq, Sk) mask of which keys each query sees (None: all of them)."""
    if not causal:
        return None
    return np.asarray(q_positions)[:, None] >= np.asarray(k_positions)[None, :]


def _row_blocks(nrows: int, elements_per_row: int) -> list[slice]:
    step = max(1, BLOCK_ELEMENTS // max(1, elements_per_row))
    return [slice(i, min(i + step, nrows)) for i in range(0, nrows, step)]


def forward_reference(inputs, positions, causal: bool, precisions, say=None) -> list[tuple]:
    """For each (dtype, round_to) of `precisions`: out (B, S, H, D), lse and delta (B, H, S) of
    the query rows at global `positions` against every key, computed in row blocks; delta =
    rowsum(dout * out), what the backward pass needs beside lse. `say`, if given, hears of the
    progress."""
    q, k, v, dout = inputs
    positions = np.asarray(positions)
    parts = [([], [], []) for _ in precisions]
    blocks = _row_blocks(len(positions), q.shape[0] * q.shape[2] * k.shape[1])
    t0 = time.perf_counter()
    for i, rows in enumerate(blocks):
        at = positions[rows]
        keep = _visible(at, np.arange(k.shape[1]), causal)
        for (dtype, round_to), (outs, lses, deltas) in zip(precisions, parts):
            out, lse = attention_ref(q[:, at], k, v, dtype=dtype, round_to=round_to, keep=keep)
            outs.append(out)
            lses.append(lse)
            deltas.append(np.einsum("bihd,bihd->bhi", dout[:, at].astype(dtype), out))
        if say and ((i + 1) % max(1, len(blocks) // 4) == 0 or i + 1 == len(blocks)):
            say(f"query rows {rows.stop}/{len(positions)} ({time.perf_counter() - t0:.1f} s)")
    return [(np.concatenate(o, axis=1), np.concatenate(l, axis=2), np.concatenate(d, axis=2))
            for o, l, d in parts]


def _rounded(x, round_to):
    """x as a naive implementation returns it: in the inputs' half precision, if they are."""
    return x if round_to is None else x.astype(round_to).astype(np.float64)


def _dq_reference(inputs, positions, stats, causal, precision):
    """dq (B, S, H, D) of the query rows at global `positions`, whose lse and delta `stats`
    holds: each query row's gradient needs only its own statistics and every key."""
    q, k, v, dout = inputs
    (dtype, round_to), (_, lse, delta) = precision, stats
    at = np.asarray(positions)
    dq, _, _ = step_backward_ref(q[:, at], k, v, dout[:, at], lse, delta,
                                 _visible(at, np.arange(k.shape[1]), causal), dtype=dtype,
                                 round_to=round_to)
    return _rounded(dq, round_to)


def _dkv_part(inputs, positions, keys, stats, causal, precision):
    """The share of dk, dv (B, len(keys), Hkv, D) at global key positions `keys` that flows from
    the query rows at global `positions` (whose lse and delta `stats` holds), in row blocks;
    summed over every rank's query rows, they are the whole gradient."""
    q, k, v, dout = inputs
    (dtype, round_to), (_, lse, delta) = precision, stats
    positions = np.asarray(positions)
    dk = np.zeros((k.shape[0], len(keys), *k.shape[2:]), dtype)
    dv = np.zeros_like(dk)
    for rows in _row_blocks(len(positions), q.shape[0] * q.shape[2] * len(keys)):
        at = positions[rows]
        _, dk_rows, dv_rows = step_backward_ref(
            q[:, at], k[:, keys], v[:, keys], dout[:, at], lse[:, :, rows], delta[:, :, rows],
            _visible(at, keys, causal), dtype=dtype, round_to=round_to)
        dk += dk_rows
        dv += dv_rows
    return dk, dv


def checked_kv_heads(kv_heads: int) -> list[int]:
    """The kv heads whose dk, dv are checked: CHECKED_KV_HEADS of them (all, if fewer), chosen at
    random from SAMPLE_SEED (the same on every rank and every run), ascending."""
    rng = np.random.default_rng(SAMPLE_SEED)
    chosen = rng.choice(kv_heads, min(CHECKED_KV_HEADS, kv_heads), replace=False)
    return sorted(int(h) for h in chosen)


def check(group, args, inputs, got: dict, say) -> dict:
    """This rank's {quantity: [passed, err, bound, naive_err]} for out, dq, dk, dv of `got` (host
    arrays of this rank's shard) under FlashAttention's rule (module docstring: which rows and
    heads, and why)."""
    rank, size, n = group.rank, group.size, args.seqlen
    split = partition(args.layout, size, n)  # as burstcu.shard splits the sequence
    positions = [np.asarray(split.positions(r)) for r in range(size)]
    stride = sample_stride(n, args.sample_rows)
    samples = [sampled_rows(positions[r], stride, r) for r in range(size)]
    truth, naive, round_to, eps = _precision(args.dtype)
    precisions = [(truth, None), (naive, round_to)]
    mine, sample = positions[rank], samples[rank]
    t0 = time.perf_counter()
    sampled = forward_reference(inputs, mine[sample], args.causal, precisions)
    dqs = [_dq_reference(inputs, mine[sample], s, args.causal, p) for s, p in zip(sampled, precisions)]
    say(f"  reference out, dq at this rank's {len(sample)} sampled rows, every head "
        f"({time.perf_counter() - t0:.1f} s)")
    q, k, v, dout = inputs
    kv_heads = checked_kv_heads(k.shape[2])
    heads = [h for h in range(q.shape[2]) if h // (q.shape[2] // k.shape[2]) in kv_heads]
    few_heads = (q[:, :, heads], k[:, :, kv_heads], v[:, :, kv_heads], dout[:, :, heads])
    say(f"  reference out, lse, delta at every row of kv heads {kv_heads} (query heads {heads}):")
    whole = forward_reference(few_heads, mine, args.causal, precisions, lambda m: say(f"    {m}"))
    t0 = time.perf_counter()
    keys = np.concatenate([positions[r][samples[r]] for r in range(size)])
    parts = [g for stats, precision in zip(whole, precisions)
             for g in _dkv_part(few_heads, mine, keys, stats, args.causal, precision)]
    dk_t, dv_t, dk_n, dv_n = _allreduce(group, np.stack(parts).astype(np.float64))  # all ranks' rows
    start = sum(len(s) for s in samples[:rank])
    own = slice(start, start + len(sample))
    say(f"  reference dk, dv of kv heads {kv_heads} at all ranks' {len(keys)} sampled rows, summed "
        f"over ranks ({time.perf_counter() - t0:.1f} s)")
    # (got, reference, naive) pieces of each quantity, judged together
    cases = {"out": [(got["out"][:, sample], sampled[0][0], sampled[1][0]),
                     (got["out"][:, :, heads], whole[0][0], whole[1][0])],
             "dq": [(got["dq"][:, sample], dqs[0], dqs[1])],
             "dk": [(got["dk"][:, sample][:, :, kv_heads], dk_t[:, own], _rounded(dk_n[:, own], round_to))],
             "dv": [(got["dv"][:, sample][:, :, kv_heads], dv_t[:, own], _rounded(dv_n[:, own], round_to))]}
    joined = {name: [np.concatenate([np.ravel(piece[i]) for piece in pieces]) for i in range(3)]
              for name, pieces in cases.items()}
    # each quantity's scale over every rank's rows: the rounding noise of the whole result
    scales = _allreduce(group, np.array([largest_finite(ref) or 0.0 for _, ref, _ in joined.values()]),
                        "max")
    return {name: _fa_rule(arrays, eps, scale) for (name, arrays), scale in zip(joined.items(), scales)}


def _fa_rule(arrays, eps: float, scale: float) -> list:
    """[passed, err, bound, naive_err] of (got, ref, naive) under FlashAttention's rule, its
    rounding noise at `scale` (the quantity's max|ref| over every rank)."""
    got, ref, plain = arrays
    passed, err, bound = within_fa_rule(np.asarray(got, np.float64), ref, plain, eps, FA_FACTOR,
                                        scale=scale or 1.0)
    return [bool(passed), err, bound, max_err(plain, ref)]


def _allreduce(group, x, op: str = "sum"):
    """The sum (or max) over every rank of a float64 reference part (host arrays, over MPI
    whatever the backend's transport)."""
    if group.size == 1:
        return x
    from mpi4py import MPI

    total = np.ascontiguousarray(x, np.float64)
    request = group.comm.Iallreduce(MPI.IN_PLACE, [total, MPI.DOUBLE],
                                    op={"sum": MPI.SUM, "max": MPI.MAX}[op])
    poll_until(request.Test, deadline_after(group.timeout), lambda: CommTimeoutError(
        f"rank {group.rank} waited {group.timeout:g} s for every rank's reference part"))
    return total


# ------------------------------------------------------------------------------------------------
# what rank 0 prints

def _progress(message: str) -> None:
    """Rank 0's progress through the check, on stderr (stdout keeps the report)."""
    print(message, file=sys.stderr, flush=True)


def _describe(args, group) -> None:
    """What runs and what is checked, before anything runs (two lines)."""
    size, n = group.size, args.seqlen
    hkv = args.kv_heads or args.heads
    truth, naive, round_to, _ = _precision(args.dtype)
    checked = "" if args.no_check else (
        f"; then each rank checks out, dq, dk, dv against an independent {truth.__name__} reference "
        f"(burstcu.testing.reference)")
    print(f"burstcu demo: BurstAttention forward + backward (strategy \"burst\") on {size} ranks, "
          f"backend {group.backend}, q (B, N, H, D) = ({args.batch}, {n}, {args.heads}, {args.headdim}), "
          f"k, v {hkv} heads, {args.dtype}, causal={args.causal}, layout {args.layout} "
          f"({n // size}{'' if n % size == 0 else f'-{n // size + 1}'} rows per rank){checked}", flush=True)
    if args.no_check:
        return
    plain = f"{naive.__name__}" + (f" rounded to {args.dtype}" if round_to is not None else "")
    stride = sample_stride(n, args.sample_rows)
    sample = "every row" if stride == 1 else f"shard edges + 1 random row in every {stride}"
    print(f"check: out, dq at sampled rows ({sample}) of every head; out at every row and dk, dv "
          f"at the sampled rows of kv heads {checked_kv_heads(hkv)} (their reference needs a "
          f"forward pass over every row); err = max |x - ref|, PASSED if err <= {FA_FACTOR:g} x "
          f"err(naive {plain} attention) + 8 eps max|ref| over all ranks (FlashAttention's rule)",
          flush=True)


def _report(args, size, rows, ql, kl):
    """The per-rank table (errors, times, bytes), the byte formula, then one verdict per rank."""
    errors = "" if args.no_check else (
        f"; err = max |x - {_precision(args.dtype)[0].__name__} ref| on the checked rows")
    print(f"times of a second pass, after one untimed warm-up (compiles excluded){errors}")
    errs = list(rows[0].get("checks", {}))
    head = f"{'rank':>4} " + "".join(f"{'err_' + e:>11}" for e in errs) + f"{'fwd s':>8}{'bwd s':>8}{'fwd bytes':>13}{'msgs':>5}{'bwd bytes':>13}{'msgs':>5}"
    print(head)
    for r in rows:
        print(f"{r['rank']:>4} " + "".join(f"{r['checks'][e][1]:>11.2e}" for e in errs)
              + f"{r['fwd_s']:>8.3f}{r['bwd_s']:>8.3f}{r['fwd_bytes']:>13,}{r['fwd_msgs']:>5}{r['bwd_bytes']:>13,}{r['bwd_msgs']:>5}")
    mask = dict(layout=partition(args.layout, size, args.seqlen), causal=args.causal)  # any N
    fwd = [burst.forward_bytes(size, ql, kl, kl, rank=r, **mask) for r in range(size)]
    bwd = [burst.backward_bytes(size, ql, kl, kl, rank=r, **mask) for r in range(size)]
    print(f"formula per rank: forward sends*(|K|+|V|) = "
          f"{' / '.join(f'{n:,}' for n in fwd)} bytes (ranks 0..{size - 1}: a "
          f"block travels only while a rank it reaches needs it); backward bundles*(|Q|+|dO|+|D|+|lse|) "
          f"+ dqs*|dQ {'fp64' if args.dtype == 'float64' else 'fp32'}| = {' / '.join(f'{n:,}' for n in bwd)}"
          f" bytes (a bundle goes only as far as the last rank that needs it)")
    for r in rows:
        print(verdict(r["rank"], r.get("checks")))
    sys.stdout.flush()


def verdict(rank: int, checks: dict | None) -> str:
    """One rank's verdict line: PASSED or FAILED, with the quantity nearest (or past) its bound."""
    if checks is None:
        return f"rank {rank}: not checked (--no-check)"
    worst = max(checks, key=lambda name: checks[name][1] / checks[name][2] if checks[name][2] else math.inf)
    passed = all(ok for ok, *_ in checks.values())
    ok, err, bound, naive_err = checks[worst]
    return (f"rank {rank}: {'PASSED' if passed else 'FAILED'}  worst {worst}: max |{worst} - ref| "
            f"{err:.2e} {'<=' if ok else '>'} {bound:.2e} = {FA_FACTOR:g} x naive err {naive_err:.2e}"
            f" + 8 eps max|ref| of all ranks {bound - FA_FACTOR * naive_err:.2e}")


if __name__ == "__main__":
    sys.exit(main())
