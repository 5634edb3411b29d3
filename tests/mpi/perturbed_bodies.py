"""Randomized disagreement under `mpiexec -n N` (any N): the bodies of
tests/test_failures.py::test_one_rank_perturbed_calls_agree and
::test_one_rank_perturbed_adapter_calls_agree.

Each drawn call (from one seed on every rank) is one of: `attention` (strategy, layout, causal,
window, documents, block mask, scale), `attention_backward`, `linear_attention` and its backward
(lasp2, lasp1), `decode`, a `KVCache` (made, filled from a prefill, appended to, decoded from;
paged or not) and `unshard`, over shapes and dtypes; or (`one_rank_perturbed_adapter_calls`)
one of the calls `burstcu.torch` and `burstcu.jax` take, made through the adapter, a backward by
the framework's autodiff (torch autograd; `jax.vjp`, eager or under `jax.jit`). Every rank makes
the call; then, once for each change `changes` lists for it, every rank makes it again with that
argument changed on one drawn rank. A change that alters the problem (a keyword, a shape, a
dtype, the array type, a shorter shard) must raise on every rank where the unchanged call
returned; a change that does not (a strided, read-only or Fortran-ordered array, a CPU torch
tensor, NumPy scalars and arrays for Python ones, documents and layout in a `Sharding` for the
same as keywords) must return the same bits; a few (return_lse, check, uneven, a NaN
in the input, non-native byte order) may go either way. Through an adapter, changes of its own
join them: a NumPy array for q (the same bits), `torch.autocast` (a cast of the inputs) or
`jax.jit` on one rank only (refused on every rank: a call from inside jit is compared as one
from another thread). On every rank alike: the outcomes are compared over MPI.COMM_WORLD, not
the transport under test, and the group's short timeout turns a rank left waiting into a failure
of this test.

Run through tests/mpi/runner.py as `perturbed_bodies:<function>`.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
from mpi4py import MPI

import burstcu

SOFTMAX = ("burst", "ring", "allgather", "ulysses", "usp")
MASKABLE = ("burst", "ring", "allgather")   # windows, documents and block masks
LINEAR = ("lasp2", "lasp1")
CALLS = ("attention", "attention_backward", "linear_attention", "linear_attention_backward",
         "decode", "kvcache", "unshard")
ADAPTED = CALLS[:6]                  # what burstcu.torch and burstcu.jax take (kvcache: decode)
TORCH = importlib.util.find_spec("torch") is not None   # an optional extra
# what the message of a change refused on every rank must say, by the change's name
SAYS = {"jit": "jax.jit", "eager": "jax.jit"}


def draw_call(rng, size: int, adapters: bool = False) -> dict:
    """A valid call: {fn, b, n (global rows), h, hkv, d, dtype, packed, kw}, the same on every
    rank; with adapters, one of ADAPTED made through {via: "torch" or "jax"} (jax: {jit}) too."""
    fn = str(rng.choice(ADAPTED if adapters else CALLS))
    call = {"fn": fn, "b": int(rng.integers(1, 3)), "n": 8 * size * int(rng.integers(1, 3)),
            "hkv": size, "h": size * int(rng.choice([1, 2])), "d": int(rng.choice([8, 16])),
            "dtype": str(rng.choice(["float32", "float64"])), "packed": False, "kw": {}}
    kw = call["kw"]
    if fn in ("attention", "attention_backward"):
        kw.update(strategy=str(rng.choice(SOFTMAX)), causal=bool(rng.integers(2)),
                  layout=str(rng.choice(["contiguous", "zigzag"])))
        if kw["strategy"] == "usp":
            kw["ulysses_degree"] = 1
        if rng.random() < 0.3:
            kw["softmax_scale"] = float(rng.choice([0.25, 0.5]))
        if kw["strategy"] in MASKABLE:
            if rng.random() < 0.3:
                kw["window_size"] = (int(rng.integers(1, 6)), 0 if kw["causal"] else int(rng.integers(0, 6)))
            if rng.random() < 0.25:
                call["packed"], kw["cu_seqlens"] = True, [0, call["n"] // 2, call["n"]]
            elif rng.random() < 0.2 and "window_size" not in kw:
                del kw["causal"]
                kw["block_mask"] = 2     # the mask's cut: n // 2
            elif rng.random() < 0.25:    # uneven shards: a Sharding's lengths in place of the group
                del kw["layout"]
                call["lengths"] = _uneven(call["n"], size, 0)
            if call["packed"]:           # the documents and layout as keywords or in a Sharding
                call["sharding"] = bool(rng.integers(2))
        if fn == "attention" and rng.random() < 0.3:
            kw["return_lse"] = True
    elif fn.startswith("linear"):
        kw.update(causal=bool(rng.integers(2)), layout=str(rng.choice(["contiguous", "zigzag"])),
                  strategy=str(rng.choice(LINEAR)))
    elif fn == "decode":
        call["n"] = 4 * size
        if rng.random() < 0.4:
            kw["softmax_scale"] = 0.5
        if rng.random() < 0.3:
            kw["return_lse"] = True
    elif fn == "kvcache":    # KVCache, from_prefill, append, decode
        call.update(n=4, capacity=8, tokens=1, page_size=int(rng.choice([0, 4])))
        if rng.random() < 0.4:
            kw["softmax_scale"] = 0.5
    else:
        kw["layout"] = str(rng.choice(["contiguous", "zigzag"]))
    if adapters:
        call.update(via=str(rng.choice(["torch", "jax"])), jit=bool(rng.integers(2)))
        if fn == "attention":
            kw.pop("return_lse", None)       # the adapters' attention returns out alone
    return call


def _uneven(n: int, size: int, shift: int) -> list[int]:
    """`size` shard lengths adding up to n, rank r's growing with r (and `shift` rows moved
    from the last rank to the first)."""
    lengths = [2 * (r + 1) for r in range(size)]
    lengths[-1] += n - sum(lengths) - shift
    lengths[0] += shift
    return lengths


def changes(call: dict) -> list[tuple[str, str, object]]:
    """(name, expectation, change) for `call`: expectation "raises", "same" (the same bits) or
    "either"; change: ("set", field of `call`, value), ("kw", keyword, value), ("kw-", keyword,
    None) to drop it, or ("array", edit of `_edited`, True)."""
    fn, kw = call["fn"], call["kw"]
    out = [("dtype", "raises", ("set", "dtype", "float64" if call["dtype"] == "float32" else "float32")),
           ("float16", "raises", ("set", "dtype", "float16")),
           ("int32", "raises", ("set", "dtype", "int32")),
           ("head dim", "raises", ("set", "d", 2 * call["d"])),
           ("heads", "raises", ("set", "h", 2 * call["h"])),
           ("a list", "raises", ("array", "list", True)),
           ("strided", "same", ("array", "strided", True)),
           ("read-only", "same", ("array", "readonly", True)),
           ("Fortran order", "same", ("array", "fortran", True)),
           ("byte order", "either", ("array", "byteswap", True)),
           ("a NaN", "either", ("array", "nan", True))]
    if TORCH:
        out.append(("a torch tensor", "same", ("array", "tensor", True)))
    if fn != "unshard":
        out.append(("kv heads", "raises", ("set", "hkv", call["hkv"] + 1)))
    if not call["packed"]:
        out.append(("batch", "raises", ("set", "b", call["b"] + 1)))
    if fn not in ("decode", "kvcache", "unshard"):
        out.append(("shorter shard", "raises", ("array", "shorter", True)))
    if fn == "kvcache":
        out += [("capacity", "raises", ("set", "capacity", 9)),
                ("pages", "raises", ("set", "page_size", 2 if call["page_size"] else 4)),
                ("tokens appended", "raises", ("set", "tokens", 2)),
                ("rows of the prefill", "either", ("set", "n", 3))]
    if "lengths" in call:
        shifted = _uneven(call["n"], len(call["lengths"]), 1)
        out.append(("shard lengths", "raises", ("set", "lengths", shifted)))
    if "sharding" in call:
        form = "documents as keywords" if call["sharding"] else "documents in a Sharding"
        out.append((form, "same", ("set", "sharding", not call["sharding"])))
    if "causal" in kw:
        out += [("causal", "raises", ("kw", "causal", not kw["causal"])),
                ("causal as np.bool_", "same", ("kw", "causal", np.bool_(kw["causal"])))]
    if "layout" in kw:
        other = "zigzag" if kw["layout"] == "contiguous" else "contiguous"
        out.append(("layout", "raises", ("kw", "layout", other)))
    if "strategy" in kw:
        pool = LINEAR if fn.startswith("linear") else MASKABLE if call["packed"] else ("burst", "ring")
        other = next(s for s in pool if s != kw["strategy"])
        out.append(("strategy", "raises", ("kw", "strategy", other)))
    if fn in ("attention", "attention_backward", "decode", "kvcache"):
        scale = kw.get("softmax_scale")
        out += [("scale", "raises", ("kw", "softmax_scale", 0.75 if scale is None else 2 * scale)),
                ("NaN scale", "raises", ("kw", "softmax_scale", float("nan")))]
        if scale is not None:
            out.append(("scale as np.float64", "same", ("kw", "softmax_scale", np.float64(scale))))
    if fn in ("attention", "attention_backward"):
        window = kw.get("window_size", (-1, -1))
        out += [("window", "raises", ("kw", "window_size", (2, 0) if window == (-1, -1) else (-1, -1))),
                ("uneven", "either", ("kw", "uneven", True)),
                ("ulysses_degree", "raises", ("kw", "ulysses_degree", 2))]
        if window != (-1, -1):
            out += [("window as a list", "same", ("kw", "window_size", list(window))),
                    ("window as an array", "same", ("kw", "window_size", np.array(window)))]
        if call["packed"]:
            docs = kw["cu_seqlens"]
            out += [("documents", "raises", ("kw", "cu_seqlens", [0, docs[-1] // 4, docs[-1]])),
                    ("documents as an array", "same", ("kw", "cu_seqlens", np.array(docs, np.int32))),
                    ("documents as a tuple", "same", ("kw", "cu_seqlens", tuple(docs)))]
        else:
            out.append(("documents added", "raises", ("kw", "cu_seqlens", [0, call["n"] // 2, call["n"]])))
        if "block_mask" in kw:
            out += [("block mask", "raises", ("kw", "block_mask", 4)),
                    ("block mask dropped", "raises", ("kw-", "block_mask", None))]
        else:
            out.append(("block mask added", "raises", ("kw", "block_mask", 2)))
    if fn == "attention":
        out.append(("return_lse", "either", ("kw", "return_lse", not kw.get("return_lse", False))))
    if fn == "attention_backward":
        out += [("check", "either", ("kw", "check", True)),
                ("shorter lse", "raises", ("array", "short_lse", True))]
    return out if "via" not in call else _adapter_changes(call, out)


def _adapter_changes(call: dict, plain: list) -> list:
    """`plain`'s changes for a call through an adapter, and the adapter's own: no lse or byte order
    to change (the adapter keeps lse; torch takes native order only), no torch tensor (what
    the torch adapter is given anyway, what JAX does not take), no list for JAX (jax.jit and
    jax.vjp take a list as a tree of numbers); for torch a NumPy array for q (forward calls:
    JAX converts one itself) and autocast (the forward's inputs cast to bfloat16, not
    decode's), for JAX eager for jit or jit for eager (refused on every rank, the message
    naming jax.jit)."""
    fn, via = call["fn"], call["via"]
    dropped = ("byte order", "return_lse", "shorter lse", "a torch tensor")
    dropped += ("a list",) if via == "jax" else ()
    out = [change for change in plain if change[0] not in dropped]
    if via == "torch":
        if not fn.endswith("backward"):
            out.append(("a NumPy array for q", "same", ("array", "numpy", True)))
        cast = call["dtype"] == "float32" and fn not in ("decode", "kvcache")
        out.append(("autocast", "raises" if cast else "same", ("array", "autocast", True)))
    else:
        out.append(("eager" if call["jit"] else "jit", "raises", ("array", "jit", True)))
    return out


def changed(call: dict, change) -> dict:
    """`call` with `change` made."""
    how, key, value = change
    call = {**call, "kw": dict(call["kw"]), "arrays": dict(call.get("arrays", {}))}
    if how == "set":
        call[key] = value
    elif how == "kw":
        call["kw"][key] = value
    elif how == "kw-":
        del call["kw"][key]
    else:
        call["arrays"][key] = value
    return call


def _edited(x, edits: dict, axis: int):
    """This rank's first array as `edits` ask."""
    if edits.get("shorter"):
        x = np.take(x, np.arange(x.shape[axis] // 2), axis=axis)
    if edits.get("strided"):
        x = np.repeat(x, 2, axis=-1)[..., ::2]
    if edits.get("readonly"):
        x = x.copy()
        x.flags.writeable = False
    if edits.get("fortran"):
        x = np.asfortranarray(x)
    if edits.get("byteswap"):
        x = x.astype(x.dtype.newbyteorder(">"))
    if edits.get("nan"):
        x = x.copy()
        x.flat[0] = np.nan
    if edits.get("tensor"):
        import torch
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x.tolist() if edits.get("list") else x


def _with_mask(kw: dict, n: int) -> dict:
    """`kw` with a block mask drawn as its cut c made: keys [0, n/c) fully seen, the rest causal."""
    if not isinstance(kw.get("block_mask"), int):
        return kw
    cut = n // kw["block_mask"]
    mask = burstcu.BlockMask([[0, n], [cut, n]], [[0, cut], [cut, n]], ["full", "causal"])
    return {**kw, "block_mask": mask}


def make(group, call: dict, seed: list):
    """Run `call` on `group`: its result (arrays are drawn from `seed`, the global ones alike on
    every rank)."""
    rng = np.random.default_rng(seed)
    b, n, h, hkv, d, fn = (call[k] for k in ("b", "n", "h", "hkv", "d", "fn"))
    dtype, edits, kw = np.dtype(call["dtype"]), call.get("arrays", {}), dict(call["kw"])

    def draw(shape):
        x = rng.standard_normal(shape)
        return x.astype(dtype) if dtype.kind == "f" else x.round().astype(dtype)

    if fn == "decode":   # q alike on every rank, the cache this rank's own
        q = np.random.default_rng(seed[:2]).standard_normal((b, 1, h, d)).astype(dtype)
        k_cache, v_cache = (draw((b, n, hkv, d)) for _ in range(2))
        if "via" in call:
            return _through_adapter(call, group, [_edited(q, edits, 1), k_cache, v_cache], kw)
        return burstcu.decode(_edited(q, edits, 1), k_cache, v_cache, group, **kw)
    if fn == "kvcache":
        q = np.random.default_rng(seed[:2]).standard_normal((b, 1, h, d)).astype(dtype)
        new_rows = [np.random.default_rng(seed[:2]).standard_normal((b, call["tokens"], hkv, d))
                    for _ in "kv"]
        cache = burstcu.KVCache(group, b, call["capacity"], hkv, d, dtype,
                                page_size=call["page_size"] or None)
        cache.from_prefill(draw((b, n, hkv, d)), draw((b, n, hkv, d)))
        cache.append(*new_rows)
        if "via" in call:
            return _through_adapter(call, group, [_edited(q, edits, 1), cache], kw)
        return cache.decode(_edited(q, edits, 1), **kw)
    kw = _with_mask(kw, n)
    axis, docs = (0, [0, n // 2, n]) if call["packed"] else (1, None)
    rng = np.random.default_rng(seed[:2])    # the global arrays: alike on every rank
    whole = [draw((b, n, heads, d)) for heads in (h, hkv, hkv, h)]
    if "lengths" in call:
        group = burstcu.Sharding(group, lengths=call["lengths"])
    q, k, v, dout = (burstcu.shard(x[0] if call["packed"] else x, group, kw.get("layout"),
                                   axis=axis, cu_seqlens=docs) for x in whole)
    first = _edited(q, edits, axis)
    if fn == "unshard":
        return burstcu.unshard(first, group, kw["layout"])
    forward = {key: value for key, value in _with_mask(call.get("forward_kw", kw), n).items()
               if key != "check"}
    forward_group, forward = _in_a_sharding(group, forward,
                                            call.get("forward_sharding", call.get("sharding")))
    group, kw = _in_a_sharding(group, kw, call.get("sharding"))
    if "via" in call:
        return _through_adapter(call, group, [first, k, v, dout], kw)
    if fn in ("attention", "linear_attention"):
        return getattr(burstcu, fn)(first, k, v, group, **kw)
    if fn == "linear_attention_backward":
        return burstcu.linear_attention_backward(dout, first, k, v, group, **kw)
    out, lse = burstcu.attention(q, k, v, forward_group, return_lse=True, **forward)
    if edits.get("short_lse"):
        lse = lse[..., :-1]
    return burstcu.attention_backward(dout, first, k, v, out, lse, group, **kw)


def _in_a_sharding(group, kw: dict, sharding: bool | None) -> tuple:
    """(group, kw) with, where `sharding` and kw has documents, kw's cu_seqlens and layout moved
    into a `burstcu.Sharding` of `group`."""
    if not sharding or "cu_seqlens" not in kw:
        return group, kw
    kw = dict(kw)
    return burstcu.Sharding(group, kw.pop("layout", "contiguous"), kw.pop("cu_seqlens")), kw


def _through_adapter(call: dict, group, arrays: list, kw: dict) -> tuple:
    """call["fn"] through burstcu.torch or burstcu.jax (call["via"]) on `arrays` (q, k, v and, for
    a backward, dout; NumPy arrays, or q as an edit left it; for a KVCache, q and the cache,
    decoded from by the adapter's decode(q, cache)), each handed over as a tensor or a jax
    array but q under the "numpy" edit or not an array; a backward by the framework's autodiff
    (the adapter's forward, then its backward with dout); the results as NumPy arrays."""
    edits, backward = call.get("arrays", {}), call["fn"].endswith("_backward")
    fn = call["fn"].removesuffix("_backward")
    if fn == "kvcache":      # decode(q, cache): the cache brings its group
        fn, group = "decode", None
    native = [x if not isinstance(x, np.ndarray) or (i == 0 and edits.get("numpy")) else None
              for i, x in enumerate(arrays[:3])]
    if call["via"] == "torch":
        import torch
        import burstcu.torch as adapter
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            ins = [torch.from_numpy(x) if n is None else n for x, n in zip(arrays, native)]
        for x in ins:     # grads asked for in the forward calls too: autograd saves the inputs
            if isinstance(x, torch.Tensor) and x.is_floating_point() and fn != "decode":
                x.requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(edits.get("autocast"))):
            got = getattr(adapter, fn)(*ins, group, **kw)
        if backward:
            got.backward(torch.from_numpy(_cut(arrays[3], got.shape)).to(got.dtype))
            got = tuple(x.grad for x in ins)
        got = got if isinstance(got, tuple) else (got,)
        return tuple(x.detach().numpy() for x in got)
    import jax
    import burstcu.jax as adapter
    ins = [jax.numpy.asarray(x) if n is None else n for x, n in zip(arrays, native)]
    cache = ins[1:] if call["fn"] == "kvcache" else []    # no array: closed over, not traced
    ins = ins[:len(ins) - len(cache)]

    def adapted(*xs):
        return getattr(adapter, fn)(*xs, *cache, group, **kw)

    def run(*xs):
        if not backward:
            return adapted(*xs)
        out, pull = jax.vjp(adapted, *xs)
        return pull(jax.numpy.asarray(_cut(arrays[3], out.shape)).astype(out.dtype))
    got = (jax.jit(run) if call["jit"] != bool(edits.get("jit")) else run)(*ins)
    return tuple(np.asarray(x) for x in (got if isinstance(got, tuple) else (got,)))


def _cut(dout: np.ndarray, shape) -> np.ndarray:
    """dout's leading block of `shape` (out's, of a shorter shard's rows where q has them: a
    dout of another shape would fail in the framework on that rank alone, tracing under jit,
    before the call reached the other ranks)."""
    return dout[tuple(slice(0, n) for n in shape)]


def outcome(group, call: dict, seed: list):
    """("ok", the result as a tuple of arrays) or ("raised", "Type: message"): ValueError or
    TypeError, or JAX's runtime error carrying one from inside jax.jit."""
    try:
        got = make(group, call, seed)
    except (ValueError, TypeError) as exc:
        return "raised", f"{type(exc).__name__}: {exc}"
    except RuntimeError as exc:
        if type(exc).__name__ != "JaxRuntimeError":
            raise
        return "raised", f"{type(exc).__name__}: {exc}"
    return "ok", got if isinstance(got, tuple) else (got,)


def one_rank_perturbed_adapter_calls(calls: int = 12, seed: int = 0):
    """`one_rank_perturbed_calls` through burstcu.torch and burstcu.jax (float64 kept: JAX's x64
    on)."""
    import jax
    jax.config.update("jax_enable_x64", True)
    return one_rank_perturbed_calls(calls, seed, adapters=True)


def one_rank_perturbed_calls(calls: int = 30, seed: int = 0, adapters: bool = False):
    """`calls` drawn calls, each made unchanged, then once per change `changes` lists for it
    with that change on one drawn rank (module docstring); asserts on every rank; returns how
    many changed calls of each expectation ran and how many drawn calls every rank refused."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    group = burstcu.init(backend="numpy", timeout=20)
    ran = {"raises": 0, "same": 0, "either": 0, "refused unchanged": 0}
    for index in range(calls):
        rng = np.random.default_rng([seed, index])
        call, arrays = draw_call(rng, size, adapters), [seed, index, rank]
        base = outcome(group, call, arrays)
        assert len(set(comm.allgather(base[0]))) == 1, f"call {index}: {call}: the ranks' outcomes differ"
        if base[0] == "raised":
            ran["refused unchanged"] += 1
            continue
        for name, expect, change in changes(call):
            who = int(rng.integers(size))
            where = f"call {index}: {call['fn']} {call['kw']}, {name} changed on rank {who}"
            base_form = {"forward_kw": call["kw"], "forward_sharding": call.get("sharding")}
            got = outcome(group, {**changed(call, change), **base_form} if rank == who else call, arrays)
            kinds = comm.allgather(got[0])
            assert len(set(kinds)) == 1, f"{where}: the ranks' outcomes differ: {kinds} ({got[1]!s:.300})"
            ran[expect] += 1
            if expect == "raises" and size > 1:
                assert got[0] == "raised", f"{where}: accepted on every rank"
                assert SAYS.get(name, "") in got[1], f"{where}: the message does not say {SAYS[name]!r}"
            if expect == "same":
                assert got[0] == "ok", f"{where}: refused: {got[1]}"
                assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(base[1], got[1])), \
                    f"{where}: another result"
    group.close()
    return ran
