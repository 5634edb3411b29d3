"""The selftest's overlap line reports a figure only when it is a measurement: its uncertainty
(the timings' jitter over the exchange's time) below `selftest.MEASURABLE`, the rule
bench/cpu/overlap.py applies too; otherwise it says "not measurable here" with the numbers. A
figure below zero by more than its uncertainty says what it means; one within its uncertainty of
zero carries no such note (it is a timing, never part of PASSED)."""

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
    assert ov["overlap"] == pytest.approx(0.85) and ov["overlap_uncertainty"] == pytest.approx(0.10)
    assert "overlap 0.85±0.10 (1 = exchange fully hidden)" in text


def test_noise_larger_than_the_exchange_is_not_a_figure():
    """The 2-rank selftest used to print `overlap -6.86` here: 0.7 ms of exchange against
    compute that varied by tens of ms."""
    ov, text = _line(0.04435, 0.00074, 0.0496, 0.0394)
    assert ov["overlap"] is None and ov["overlap_raw"] == pytest.approx(-6.1, abs=0.1)
    assert ("overlap not measurable here (±53.24 from a timing jitter of 39.40 ms, the three timings' "
            "ranges added, a measurement needs < 0.15; exchange 0.74 ms)") in text
    assert not re.search(r"overlap -?\d", text)


@pytest.mark.parametrize("jitter_s, uncertainty", [
    (0.00396, 0.99),    # the audit's "overlap 0.08±0.99": jitter under the exchange, no figure
    (0.0006, 0.15),     # at the threshold: refused
])
def test_an_uncertain_figure_is_not_printed(jitter_s, uncertainty):
    """Jitter smaller than the exchange but an uncertainty of 0.15 or more: not a measurement
    (the line used to print a figure whenever the jitter was below the exchange's time)."""
    ov, text = _line(0.010, 0.004, 0.0137, jitter_s)
    assert ov["overlap"] is None and ov["overlap_raw"] == pytest.approx(0.075)
    assert ov["overlap_uncertainty"] == pytest.approx(uncertainty)
    assert f"overlap not measurable here (±{uncertainty:.2f} from a timing jitter of " in text
    assert f"a measurement needs < {selftest.MEASURABLE}; exchange 4.00 ms)" in text
    assert not re.search(r"overlap -?\d", text)


def test_just_under_the_threshold_is_a_figure():
    ov, text = _line(0.010, 0.004, 0.0137, 0.000596)
    assert ov["overlap"] == pytest.approx(0.075) and ov["overlap_uncertainty"] < selftest.MEASURABLE
    assert "overlap 0.07±0.15 (1 = exchange fully hidden)" in text


def test_a_negative_figure_beyond_its_uncertainty_says_what_it_means():
    ov, text = _line(0.010, 0.004, 0.016, 0.0004)
    assert ov["overlap"] == pytest.approx(-0.5) and ov["overlap_note"] == selftest.NEGATIVE
    assert ("overlap -0.50±0.10 (1 = exchange fully hidden; negative beyond its uncertainty: compute "
            "and exchange together took longer than one after the other") in text
    assert "do not decide PASSED" in text


def test_a_negative_figure_within_its_uncertainty_of_zero_has_no_note():
    """-0.05 ± 0.10 may well be 0: no "slower together" claim (one used to come with any sign)."""
    ov, text = _line(0.010, 0.004, 0.0142, 0.0004)
    assert ov["overlap"] == pytest.approx(-0.05) and ov["overlap_note"] is None
    assert "overlap -0.05±0.10 (1 = exchange fully hidden)" in text and "negative" not in text


@pytest.mark.parametrize("raw, uncertainty, figure, note", [
    (0.5, 0.1499, 0.5, None),
    (0.5, 0.15, None, "not measurable here (±0.15 from "),
    (-0.2, 0.1, -0.2, selftest.NEGATIVE),
    (-0.1, 0.1, -0.1, None),             # raw + uncertainty == 0: not beyond it
    (None, 0.0, None, "no exchange"),
])
def test_the_rule(raw, uncertainty, figure, note):
    """Unit: `judge_overlap`, the one rule (bench/cpu/overlap.py's pass_figures calls it)."""
    got_figure, got_note = selftest.judge_overlap(raw, uncertainty, "the spread over 3 repeats", 0.004)
    assert got_figure == figure
    assert (got_note is None) if note is None else got_note.startswith(note)
