"""Every strategy tells the local op which forward fold is the pass's last (`LocalOps.forward_step`'s
`last`, on which the Hopper kernel writes out and lse itself and leaves the state unwritten): on
every rank, no fold follows the one said to be last, and the last one is said to be so, under
full, causal, windowed and document masks over both layouts and both ways round the ring, on
1-4 ranks (threads over the loopback transport, the NumPy op)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import burstcu
from burstcu import engine
from burstcu.layout import partition
from burstcu.ops.base import DelegatingOps
from burstcu.testing.world import run_ranks


class _LastFolds(DelegatingOps):
    """The op's forward_step calls as their `last` flags, a list a pass (forward_init opens one)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.passes: list[list[bool]] = []

    def forward_init(self, q, softmax_scale):
        self.passes.append([])
        return super().forward_init(q, softmax_scale)

    def forward_step(self, state, k, v, blocks, last=False) -> None:
        self.passes[-1].append(bool(last))
        super().forward_step(state, k, v, blocks, last)


MASKS = {
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=False, window_size=(5, 9)),
    "documents": dict(causal=True, cu_seqlens=()),   # four documents (the test cuts them)
}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["burst", "burst both ways", "ring", "allgather", "ulysses", "usp"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_the_last_fold_is_said_to_be_last(size, strategy, layout, mask):
    n = 8 * 2 * size * (5 if mask == "documents" else 1)   # zigzag: 2G chunks of 8 (or 40) rows
    options = dict(MASKS[mask])
    if "cu_seqlens" in options:
        options["cu_seqlens"] = (0, 3, n // 2, n // 2 + 1, n)
    if strategy == "usp" and size % 2:
        pytest.skip("usp: pairs of ranks")
    rng = np.random.default_rng(size)
    q, k, v = (rng.standard_normal((1, n, 12, 8)) for _ in range(3))   # 12 heads: Ulysses on 1-4

    docs = options.pop("cu_seqlens", None)

    def body(group):
        ops = group.ops = _LastFolds(group.ops)
        sharding = burstcu.Sharding(group, layout=layout, cu_seqlens=docs)
        shards = [sharding.shard(x) for x in (q, k, v)]
        if strategy == "burst both ways":
            engine.get("burst", bidirectional=True).forward(
                *shards, ops, group.transport, softmax_scale=0.3, cu_seqlens=docs,
                layout=partition(layout, size, n, docs), **options)
        else:
            burstcu.attention(*shards, sharding, strategy=strategy,
                              ulysses_degree=2 if strategy == "usp" else None, **options)
        return ops.passes

    for rank, passes in enumerate(run_ranks(size, body, timeout=60)):
        assert passes, rank
        for flags in passes:   # a pass without folds (a rank whose rows see no key) says nothing
            assert flags == [False] * (len(flags) - 1) + [True] or not flags, (rank, flags)


def _random_block_mask(rng, n: int) -> burstcu.BlockMask:
    """Rectangles over disjoint query ranges (no pair twice), each a random key range and kind."""
    cuts = np.sort(rng.choice(np.arange(1, n), 3, replace=False))
    q = np.stack([np.r_[0, cuts], np.r_[cuts, n]], axis=1)
    k0 = rng.integers(0, n - 1, len(q))
    k = np.stack([k0, k0 + 1 + rng.integers(0, n - k0)], axis=1)
    return burstcu.BlockMask(q, k, rng.integers(0, 4, len(q)).tolist())


@pytest.mark.parametrize("size", [2, 3, 4, 6])
@pytest.mark.parametrize("strategy", ["burst", "burst both ways", "ring", "allgather"])
def test_the_last_fold_under_block_masks_and_uneven_shards(size, strategy):
    """The same under block masks (a rank may hold a block only to pass it on: six ranks of 24
    rows, queries [0, 72) and [72, 144) seeing keys [91, 135) and [121, 136)) and random ones,
    over contiguous shards of uneven lengths."""
    rng = np.random.default_rng(size)
    n = 24 * size
    lengths = [int(x) for x in np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, n), size - 1,
                                                                      replace=False)), n])]
    masks = [_random_block_mask(rng, n) for _ in range(3)]
    if size == 6:
        masks.append(burstcu.BlockMask([(0, 72), (72, 144)], [(91, 135), (121, 136)], ["full", "full"]))
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for _ in range(3))

    def body(group):
        ops = group.ops = _LastFolds(group.ops)
        for mask, split in itertools.product(masks, (None, lengths)):
            sharding = burstcu.Sharding(group, lengths=split)
            shards = [sharding.shard(x) for x in (q, k, v)]
            if strategy == "burst both ways":
                engine.get("burst", bidirectional=True).forward(
                    *shards, ops, group.transport, causal=False, softmax_scale=0.3, block_mask=mask,
                    layout=partition("contiguous", size, n, lengths=None if split is None else tuple(split)))
            else:
                burstcu.attention(*shards, sharding, strategy=strategy, block_mask=mask)
        return ops.passes

    for rank, passes in enumerate(run_ranks(size, body, timeout=60)):
        assert len(passes) == 2 * len(masks), rank
        for flags in passes:
            assert flags == [False] * (len(flags) - 1) + [True] or not flags, (rank, flags)
