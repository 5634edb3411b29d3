"""Sliding windows (`window_size=(left, right)`, flash-attn's convention): which ring steps a
window lets the engine skip, and bad windows refused. Windows on every strategy against the
float64 reference: tests/test_mask_kinds.py."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu.layout import step_blocks


def test_a_narrow_window_computes_only_neighbouring_steps():
    """Contiguous shards of 16 rows, window (4, 0): a rank's queries see only its own keys and
    the last 4 of its left neighbour's; every other step has no block (nothing computed)."""
    for q_rank in range(4):
        sources = [s for s in range(4) if step_blocks("contiguous", q_rank, s, 4, 16, True, (4, 0))]
        assert sources == ([q_rank - 1, q_rank] if q_rank else [0])
    (block,) = step_blocks("contiguous", 2, 1, 4, 16, True, (4, 0))
    assert (block.causal, block.left, block.right) == (False, 4, -1)


@pytest.mark.parametrize("window,causal,message", [
    ((3, 2), True, "right bound is the diagonal"), ((-2, 0), False, "an int from -1"),
    ((3,), False, "must be \\(left, right\\)"), ((1.5, 0), False, "an int from -1"),
    ((0, 2**62 + 1), False, "to 2\\^62"), ((2**64, 0), True, "to 2\\^62")])
def test_bad_windows_are_refused(window, causal, message):
    q = np.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=message):
        burstcu.attention(q, q, q, causal=causal, window_size=window)
