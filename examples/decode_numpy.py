"""Prefill a prompt over G ranks, then decode greedily against the sharded KV cache.

    mpiexec -n N python -m mpi4py examples/decode_numpy.py [--prompt 37] [--new 12] [--json F]
    python examples/decode_numpy.py                      # one process: the same tokens

A one-layer attention model with random weights (NumPy, float64): token embedding plus
sinusoidal position features, q/k/v
projections (GQA: 4 query heads on 2 kv heads), attention, output projection, unembedding.
Prefill: the prompt is sharded with layout="zigzag" and attended causally with
`burstcu.attention`; each rank's K/V shard goes into a `burstcu.KVCache` (`from_prefill`).
Decode: the next token's q, k, v are the same on every rank; `KVCache.append` stores the new K/V
on one rank (balanced) and `KVCache.decode` attends over every rank's rows; the greedy next token
is the argmax of the logits. Prints the tokens (and writes them with --json); they equal a
one-process run's and `reference_generate`'s (plain NumPy, no burstcu).

It checks itself against that float64 reference: every attention output that chose a token
(the prefill's last row, then each decode) against `reference_attention` over the same tokens,
within TOLERANCE, and the tokens against `reference_generate`'s. On a mismatch it prints the
error and the tolerance and exits 1 (on every rank). `python -m mpi4py` makes an exception on
one rank end the whole job instead of leaving the others waiting.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import burstcu
from burstcu.demo import writable_file

VOCAB, MODEL, HEADS, KV_HEADS, HEADDIM = 97, 32, 4, 2, 8
# max |attention output - float64 reference|: both are float64 (rounding ~1e-15 at these
# sizes), while a lost or misplaced cache row moves the output by ~0.1
TOLERANCE = 1e-10


def weights(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.standard_normal(shape) / np.sqrt(shape[0])
    return {"embed": rng.standard_normal((VOCAB, MODEL)), "wq": w(MODEL, HEADS * HEADDIM),
            "wk": w(MODEL, KV_HEADS * HEADDIM), "wv": w(MODEL, KV_HEADS * HEADDIM),
            "wo": w(HEADS * HEADDIM, MODEL), "unembed": w(MODEL, VOCAB)}


def positions(start: int, n: int) -> np.ndarray:
    """Sinusoidal position features (n, MODEL) of positions start .. start + n - 1."""
    pos = np.arange(start, start + n)[:, None]
    freq = 1.0 / 50.0 ** (np.arange(MODEL // 2) / (MODEL // 2))
    return np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=1)


def project(p: dict, tokens: np.ndarray, start: int = 0):
    """q (1, T, H, D), k, v (1, T, Hkv, D) of these tokens at positions start.. (their inputs
    x: (T, MODEL), embedding plus position features)."""
    x = p["embed"][tokens] + positions(start, len(tokens))
    t = len(tokens)
    return (x, (x @ p["wq"]).reshape(1, t, HEADS, HEADDIM),
            (x @ p["wk"]).reshape(1, t, KV_HEADS, HEADDIM),
            (x @ p["wv"]).reshape(1, t, KV_HEADS, HEADDIM))


def next_token(p: dict, x_last: np.ndarray, attended: np.ndarray) -> int:
    """Greedy: argmax of the logits of a residual stream the attention output dominates
    (x / 8 + attention projected), so every cache row can change the next token."""
    h = x_last / 8 + attended.reshape(-1) @ p["wo"] * 4
    return int(np.argmax(h @ p["unembed"]))


def reference_attention(p: dict, tokens, keep=None):
    """(x of the last token (MODEL,), its attention output (H, D)) over every token of `tokens`,
    in plain NumPy without burstcu: softmax over q . k / sqrt(D), kv head h // (H / Hkv).
    keep(n) -> the key positions to use of n (default: all)."""
    x, q, k, v = project(p, np.array(tokens))
    rows = np.arange(len(tokens)) if keep is None else keep(len(tokens))
    g = HEADS // KV_HEADS
    ke, ve = np.repeat(k[0, rows], g, axis=1), np.repeat(v[0, rows], g, axis=1)   # (n, H, D)
    s = np.einsum("hd,nhd->hn", q[0, -1], ke) / np.sqrt(HEADDIM)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    return x[-1], np.einsum("hn,nhd->hd", w / w.sum(axis=1, keepdims=True), ve)


def reference_generate(prompt: np.ndarray, new: int, keep=None) -> list[int]:
    """The same greedy generation in plain NumPy, without burstcu: each step recomputes the
    last token's attention over every token so far (`reference_attention`). keep(n) -> the
    key positions to use of n (default: all), for tests that show a wrong cache changes the
    tokens."""
    p = weights()
    tokens = list(prompt)
    out = []
    for _ in range(new):
        out.append(next_token(p, *reference_attention(p, tokens, keep)))
        tokens.append(out[-1])
    return out


def reference_error(prompt: np.ndarray, tokens: list[int], attended: list) -> float:
    """max |attended[i] - the reference's attention output over prompt + tokens[:i]|: each
    output that chose tokens[i], against the float64 reference fed the same tokens."""
    p = weights()
    history = list(prompt) + list(tokens)
    errors = [np.abs(out - reference_attention(p, history[:len(prompt) + i])[1]).max()
              for i, out in enumerate(attended)]
    return float(max(errors))


def generate(group, prompt: np.ndarray, new: int, capacity: int) -> tuple[list[int], list]:
    """(the `new` greedy tokens after `prompt`, the attention output (H, D) that chose each):
    a causal zigzag prefill over the group's ranks, then decode against the sharded cache."""
    p = weights()
    x, q, k, v = project(p, prompt)
    local = [burstcu.shard(a, group, layout="zigzag") for a in (q, k, v)]
    out = burstcu.attention(*local, group, causal=True, layout="zigzag")
    whole = burstcu.unshard(out, group, layout="zigzag")        # (1, N, H, D) on every rank
    cache = burstcu.KVCache(group, 1, capacity, KV_HEADS, HEADDIM, np.float64)
    cache.from_prefill(local[1], local[2])
    attended = [whole[0, -1]]
    tokens = [next_token(p, x[-1], attended[-1])]
    for i in range(new - 1):
        x_new, q_new, k_new, v_new = project(p, np.array(tokens[-1:]), len(prompt) + i)
        cache.append(k_new, v_new)
        attended.append(cache.decode(q_new)[0, 0])               # (1, 1, H, D), every rank
        tokens.append(next_token(p, x_new[-1], attended[-1]))
    return tokens, attended


def check(prompt: np.ndarray, new: int, tokens: list[int], attended: list) -> tuple[float, str | None]:
    """(the attention outputs' `reference_error`, what differs from the float64 reference's
    `new` tokens: the outputs beyond TOLERANCE, or the tokens; None when nothing does)."""
    error = reference_error(prompt, tokens, attended)
    if not error <= TOLERANCE:   # NaN fails too
        return error, (f"max |attention - float64 reference| = {error:.3g} over "
                       f"{len(attended)} steps, tolerance {TOLERANCE:g}")
    want = reference_generate(prompt, new)
    if tokens != want:
        return error, (f"tokens {tokens} differ from the reference's {want} (max |attention "
                       f"error| {error:.3g}, tolerance {TOLERANCE:g})")
    return error, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=37,
                    help="prompt length (at least the number of ranks: a row each)")
    ap.add_argument("--new", type=int, default=12, help="tokens to generate (at least 1)")
    ap.add_argument("--json", help="write {'tokens': [...]} here (rank 0)")
    args = ap.parse_args(argv)
    if args.new < 1:
        ap.error(f"--new {args.new}: generate at least 1 token")
    if args.json and not writable_file(args.json):   # before the run, not after it
        ap.error(f"--json {args.json}: not a file in a folder this user can write to")
    group = burstcu.init(backend="numpy")
    if args.prompt < group.size:              # every rank alike: rank 0 says so, each ends
        if group.rank == 0:
            print(f"decode_numpy.py: --prompt {args.prompt} is shorter than the {group.size} ranks: "
                  f"the prefill gives each rank at least one row", file=sys.stderr)
        group.close()
        return 2
    prompt = np.random.default_rng(1).integers(0, VOCAB, args.prompt)
    capacity = -(-args.prompt // group.size) + 1 + args.new     # a shard plus every new token
    tokens, attended = generate(group, prompt, args.new, capacity)
    every = group.transport.allgather_object(tokens, "tokens")
    assert all(t == tokens for t in every), "ranks generated different tokens"
    # every rank: the same inputs, the same answer
    error, mismatch = check(prompt, args.new, tokens, attended)
    if group.rank == 0:
        print(f"{group.size} rank(s), prompt {args.prompt} tokens: generated {tokens}")
        if mismatch:
            print(f"MISMATCH against the float64 reference: {mismatch}", file=sys.stderr)
        else:
            print(f"matches the float64 reference: max |attention error| {error:.3g} "
                  f"<= tolerance {TOLERANCE:g}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": group.size, "tokens": tokens}, f)
    group.close()
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
