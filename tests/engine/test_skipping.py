"""The forward ring stops a K/V block once no rank it would still reach needs it
(`burstcu.engine.burst.kv_hops`): causal over contiguous shards moves half the ring's block-hops,
a narrow window talks to the next rank only, zigzag needs every hop. Counted here against a
brute force over positions written out in tests/mpi/bodies.py::ring_sends; the bytes a real ring
sends are asserted by tests/test_mask_kinds.py and tests/test_strategies.py."""

from __future__ import annotations

import pytest

from burstcu.engine.burst import forward_sends
from tests.mpi.bodies import my_rows, ring_sends


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)),
                                           (False, (3, 2)), (False, (0, 0)), (True, (40, -1))])
def test_sends_match_the_brute_force(size, layout, causal, window):
    s = 8
    rows = [my_rows(layout, x, size, s * size) for x in range(size)]
    got = [forward_sends(r, size, s, layout, causal, window) for r in range(size)]
    assert got == [ring_sends(rows, r, causal, window) for r in range(size)]


def test_causal_contiguous_moves_half_the_hops():
    for size in (2, 4, 8):
        sends = [forward_sends(r, size, 16, "contiguous", True) for r in range(size)]
        assert sends == [r + 1 for r in range(size - 1)] + [0]   # rank r forwards blocks 0..r
        assert sum(sends) == size * (size - 1) // 2
        assert [forward_sends(r, size, 16, "zigzag", True) for r in range(size)] == [size - 1] * size


def test_a_narrow_causal_window_talks_to_the_next_rank_only():
    assert [forward_sends(r, 6, 16, "contiguous", True, (4, 0)) for r in range(6)] == [1] * 5 + [0]


def test_backward_bundles_go_only_as_far_as_needed():
    """burst.backward_counts against the spelled-out count (tests/mpi/bodies.bundle_counts, over
    dense masks) for random windows and documents, both layouts, G = 1..5; and the headline:
    causal over contiguous shards passes on G(G-1)/2 bundles in all, half of the ring's."""
    import numpy as np
    from burstcu.engine.burst import backward_counts
    from tests.mpi.bodies import bundle_counts, my_rows
    rng = np.random.default_rng(5)
    for _ in range(60):
        size, per = int(rng.integers(1, 6)), 2 * int(rng.integers(1, 5))
        n = size * per
        layout = str(rng.choice(["contiguous", "zigzag"]))
        causal = bool(rng.integers(2))
        window = (int(rng.choice([-1, 0, 3, 9])), 0 if causal else int(rng.choice([-1, 0, 2])))
        docs = None
        if layout == "contiguous" and rng.integers(2):
            docs = tuple([0, *sorted(rng.choice(np.arange(1, n), int(rng.integers(0, 4))).tolist()), n])
        groups = [my_rows(layout, r, size, n) for r in range(size)]
        for r in range(size):
            assert backward_counts(r, size, per, layout, causal, window, docs) == \
                bundle_counts(groups, r, causal, window, docs), (size, per, layout, causal, window, docs, r)
    for g in range(1, 7):
        assert sum(backward_counts(r, g, 8, "contiguous", True)[0] for r in range(g)) == g * (g - 1) // 2
        assert all(backward_counts(r, g, 8, "contiguous", False) == ((g - 1, g, g + 1) if g > 1
                                                                    else (0, 0, 0)) for r in range(g))


def test_the_backward_direction_follows_the_mask_not_the_flag():
    """A left-only window without causal is the causal window's mask: the bundles go the cheap
    way (back) either way and cost the same; a right-only window sends them forwards."""
    from burstcu.engine.burst import backward_counts, backward_direction
    g = 8
    for r in range(g):
        assert backward_counts(r, g, 8, "contiguous", False, (3, 0)) == \
            backward_counts(r, g, 8, "contiguous", True, (3, 0))
    assert backward_direction("contiguous", g, 8, False, (3, 0)) == -1
    assert backward_direction("contiguous", g, 8, False, (0, 3)) == 1
    assert sum(backward_counts(r, g, 8, "contiguous", False, (0, 3))[0] for r in range(g)) == g - 1


def test_schedules_of_past_batches_are_not_kept():
    """A varlen job brings new documents every batch: burst keeps what it derives from a
    partition and mask (needs, trips, bundle hops) for the last SCHEDULES_KEPT pairs only, so a
    past batch's partition is freed once the layout's own caches let it go."""
    import gc
    import weakref

    from burstcu.engine import burst
    from burstcu.layout import Partition, partition, rectangles

    first = None
    for batch in range(burst.SCHEDULES_KEPT + 10):
        docs = (0, 17 + batch, 300)
        part = Partition("zigzag", partition("zigzag", 4, 300, docs).runs)   # not the layout's cache
        burst.kv_hops(0, part, True, (-1, -1), docs)
        burst._bundle_hops(1, part, True, (-1, -1), docs)
        first = first or weakref.ref(part)
    rectangles.cache_clear()
    del part
    gc.collect()
    assert first() is None
    assert burst._schedule.cache_info().currsize == burst.SCHEDULES_KEPT
