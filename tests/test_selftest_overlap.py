"""The selftest's overlap line reports a figure only when it is a measurement: noise larger than
the exchange is said to be noise, and a negative figure says what it means (it is a timing,
never part of PASSED)."""

import re

import pytest

from burstcu import selftest

HEAD = "[numpy over mpi, 2 rank(s)]"


def _line(compute_s, comm_s, both_s, jitter_s):
    ov = {"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s,
          **selftest.overlap_figures(compute_s, comm_s, both_s, jitter_s)}
    return ov, selftest._overlap_line(HEAD, ov)


def test_a_hidden_exchange_is_a_figure():
    ov, text = _line(0.010, 0.004, 0.0106, 0.0004)
    assert ov["overlap"] == pytest.approx(0.85)
    assert "overlap 0.85±0.10 (1 = exchange fully hidden)" in text


def test_noise_larger_than_the_exchange_is_not_a_figure():
    """The 2-rank selftest used to print `overlap -6.86` here: 0.7 ms of exchange against
    compute that varied by tens of ms."""
    ov, text = _line(0.04435, 0.00074, 0.0496, 0.0394)
    assert ov["overlap"] is None and ov["overlap_raw"] == pytest.approx(-6.1, abs=0.1)
    assert ("overlap not measurable here (timing jitter 39.40 ms, the three timings' ranges added, "
            ">= exchange 0.74 ms)") in text
    assert not re.search(r"overlap -?\d", text)


def test_a_negative_figure_says_what_it_means():
    ov, text = _line(0.010, 0.004, 0.016, 0.001)
    assert ov["overlap"] == pytest.approx(-0.5)
    assert "overlap -0.50±0.25 (1 = exchange fully hidden; negative: compute and exchange " \
           "together took longer than one after the other" in text
    assert "do not decide PASSED" in text
