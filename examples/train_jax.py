"""Train a tiny transformer block for a few steps on sequences sharded over G ranks, in JAX,
through `burstcu.jax.attention` (differentiable, inside `jax.jit`).

    mpiexec -n 2 python -m mpi4py examples/train_jax.py [--steps 5] [--check] [--json F]
    python examples/train_jax.py --check                 # one process: the same figures

The model (float32, random initial weights): token embedding plus sinusoidal position
features, pre-norm causal self-attention (4 query heads on 2 kv heads), a ReLU MLP, and a
next-token cross-entropy loss. Every rank holds the whole batch of B sequences but only its
rows of the sequence axis (layout="zigzag", which balances causal work): `burstcu.shard` cuts
tokens, targets and the position table. A training step on rank r:

    loss_r, grads_r = jit(value_and_grad(local_loss))(params, rank r's rows)
    loss = sum(loss_r), grads = sum(grads_r)   (mpi4py: reduce to rank 0, broadcast)
    params -= lr * grads                                        (the same on every rank)

local_loss sums the cross-entropy of the rank's rows divided by the global token count, so the
ranks' losses add up to the global mean. Its gradient is rank r's share of the global gradient:
`burstcu.jax.attention`'s backward (`burstcu.attention_backward`) returns for the rank's K and
V rows the contributions of every rank's queries, and the sum over ranks of the parameter
gradients is the whole gradient. With --check every rank also trains the same model in one
process with plain JAX attention over the whole sequence (`reference_attention`, no burstcu)
and compares the loss and every gradient at every step (relative error <= --tolerance, else
exit code 1).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import burstcu
from burstcu.demo import writable_file

VOCAB, MODEL, HEADS, KV_HEADS, HEADDIM, HIDDEN = 61, 32, 4, 2, 8, 64
BATCH, SEQLEN = 2, 64


def init_params(seed: int = 0) -> dict:
    """Random weights, float32: embed (VOCAB, MODEL), wq (MODEL, H*D), wk, wv (MODEL, Hkv*D),
    wo (H*D, MODEL), w1 (MODEL, HIDDEN), w2 (HIDDEN, MODEL), unembed (MODEL, VOCAB)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
    return {"embed": w(1, VOCAB, MODEL)[0], "wq": w(MODEL, HEADS * HEADDIM),
            "wk": w(MODEL, KV_HEADS * HEADDIM), "wv": w(MODEL, KV_HEADS * HEADDIM),
            "wo": w(HEADS * HEADDIM, MODEL), "w1": w(MODEL, HIDDEN), "w2": w(HIDDEN, MODEL),
            "unembed": w(MODEL, VOCAB)}


def batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens (B, N), next tokens (B, N), position features (N, MODEL)) of the whole batch.
    The sequences follow a noisy rule (each token depends on the two before it) to be learnt."""
    rng = np.random.default_rng(seed)
    seq = np.zeros((BATCH, SEQLEN + 1), np.int64)
    seq[:, :2] = rng.integers(0, VOCAB, (BATCH, 2))
    for i in range(2, SEQLEN + 1):
        noise = rng.random(BATCH) < 0.1
        seq[:, i] = np.where(noise, rng.integers(0, VOCAB, BATCH), (3 * seq[:, i - 1] + seq[:, i - 2]) % VOCAB)
    pos = np.arange(SEQLEN)[:, None]
    freq = 1.0 / 100.0 ** (np.arange(MODEL // 2) / (MODEL // 2))
    table = np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=1).astype(np.float32)
    return seq[:, :-1], seq[:, 1:], table


def reference_attention(q, k, v):
    """Causal softmax attention over the whole sequence in plain JAX: q (B, N, H, D), k, v
    (B, N, Hkv, D) -> (B, N, H, D); kv head h // (H // Hkv)."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    scores = jnp.where(np.tril(np.ones((n, n), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def local_loss(params: dict, tokens, targets, positions, attend, total_tokens: int):
    """Cross-entropy of these rows summed and divided by the global token count.
    tokens, targets: (B, S) ints; positions: (S, MODEL); attend(q, k, v) -> out (B, S, H, D)."""
    b, s = tokens.shape
    x = params["embed"][tokens] + positions[None]
    h = _norm(x)
    q = (h @ params["wq"]).reshape(b, s, HEADS, HEADDIM)
    k = (h @ params["wk"]).reshape(b, s, KV_HEADS, HEADDIM)
    v = (h @ params["wv"]).reshape(b, s, KV_HEADS, HEADDIM)
    x = x + attend(q, k, v).reshape(b, s, HEADS * HEADDIM) @ params["wo"]
    x = x + jax.nn.relu(_norm(x) @ params["w1"]) @ params["w2"]
    logits = x @ params["unembed"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
    return -picked.sum() / total_tokens


def _sum_over_ranks(comm, tree):
    """The sum over ranks of every leaf (float32 NumPy through mpi4py), as jax arrays: reduced
    on rank 0 and broadcast, so every rank holds the same bits (an all-reduce may round
    differently on different ranks, and the parameters would drift apart)."""
    if comm is None or comm.Get_size() == 1:
        return tree
    from mpi4py import MPI

    def total(leaf):
        mine = np.array(leaf)            # a contiguous copy (0-d stays 0-d)
        out = np.empty_like(mine)
        comm.Reduce(mine, out, op=MPI.SUM, root=0)
        comm.Bcast(out, root=0)
        return jnp.asarray(out)
    return jax.tree_util.tree_map(total, tree)


def train(group, steps: int, lr: float, layout: str = "zigzag") -> list[dict]:
    """`steps` SGD steps over the ranks of `group`; per step the global loss and gradients."""
    tokens, targets, table = batch()
    mine = [jnp.asarray(burstcu.shard(x, group, layout, axis=axis))
            for x, axis in ((tokens, 1), (targets, 1), (table, 0))]

    def attend(q, k, v):
        return burstcu.jax.attention(q, k, v, group, causal=True, layout=layout)

    step = jax.jit(jax.value_and_grad(
        lambda p, t, y, pos: local_loss(p, t, y, pos, attend, tokens.size)))
    comm = getattr(group, "comm", None)
    params, history = init_params(), []
    for _ in range(steps):
        loss, grads = _sum_over_ranks(comm, step(params, *mine))
        history.append({"loss": float(loss), "grads": grads})
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return history


def train_reference(steps: int, lr: float) -> list[dict]:
    """The same training in one process with `reference_attention` (no burstcu)."""
    tokens, targets, table = batch()
    step = jax.jit(jax.value_and_grad(
        lambda p: local_loss(p, tokens, targets, table, reference_attention, tokens.size)))
    params, history = init_params(), []
    for _ in range(steps):
        loss, grads = step(params)
        history.append({"loss": float(loss), "grads": grads})
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return history


def compare(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Per step: relative error of the loss and the largest relative error of a gradient
    (max |ours - theirs| over max |theirs|, per weight)."""
    rows = []
    for a, b in zip(ours, theirs):
        grad_err = max(float(jnp.abs(a["grads"][n] - b["grads"][n]).max() /
                             jnp.abs(b["grads"][n]).max()) for n in b["grads"])
        rows.append({"loss": a["loss"], "loss_reference": b["loss"],
                     "loss_rel_err": abs(a["loss"] - b["loss"]) / abs(b["loss"]),
                     "grad_rel_err": grad_err})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (at least 1)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous"])
    parser.add_argument("--check", action="store_true",
                        help="also train in one process with plain JAX attention and compare")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest relative error of the loss and gradients with --check")
    parser.add_argument("--json", help="write the per-step figures here (rank 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: train at least 1 step")
    if args.json and not writable_file(args.json):   # before training, not after it
        parser.error(f"--json {args.json}: not a file in a folder this user can write to")
    with burstcu.init(backend="numpy") as group:
        history = train(group, args.steps, args.lr, args.layout)
        rows = compare(history, train_reference(args.steps, args.lr)) if args.check else \
            [{"loss": h["loss"]} for h in history]
        for i, row in enumerate(rows):
            extra = (f"  reference {row['loss_reference']:.6f}  rel.err loss "
                     f"{row['loss_rel_err']:.1e} grads {row['grad_rel_err']:.1e}") if args.check else ""
            print(f"rank {group.rank}/{group.size} step {i} loss {row['loss']:.6f}{extra}", flush=True)
        if args.json and group.rank == 0:
            with open(args.json, "w") as f:
                json.dump({"world": group.size, "layout": args.layout, "steps": rows}, f, indent=1)
    worst = max((max(r["loss_rel_err"], r["grad_rel_err"]) for r in rows), default=0.0) \
        if args.check else 0.0
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
