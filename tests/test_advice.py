"""Checkpoint interval advice: hand-computed Young/Daly values, the loss model, and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.plan.advice import advise, daly_interval, expected_lost_fraction, interval_to_steps, young_interval
from checkpointing.errors import CheckpointConfigError

DAY = 86400.0


def test_young_by_hand():
    # sqrt(2 * 60 * 86400) = sqrt(10_368_000) = 3219.9379 s (53.7 min)
    assert young_interval(60.0, DAY) == pytest.approx(3219.9379, abs=1e-4)
    # sqrt(2 * 2 * 3600) = sqrt(14400) = 120 s exactly
    assert young_interval(2.0, 3600.0) == 120.0


def test_daly_by_hand():
    # C = 60 s, M = 24 h: C/2M = 60/172800 = 3.47222e-4, sqrt(C/2M) = 0.0186339
    # bracket = 1 + 0.0186339/3 + 3.47222e-4/9 = 1 + 0.0062113 + 0.0000386 = 1.0062499
    # Daly = 3219.9379 * 1.0062499 - 60 = 3240.0621 - 60 = 3180.0621 s
    assert daly_interval(60.0, DAY) == pytest.approx(3180.0621, abs=1e-3)
    # C = 2 s, M = 1 h: C/2M = 1/3600, sqrt = 1/60; bracket = 1 + 1/180 + 1/32400
    # Daly = 120 * (1 + 0.0055556 + 0.0000309) - 2 = 120.67037 - 2 = 118.67037 s
    assert daly_interval(2.0, 3600.0) == pytest.approx(118.67037, abs=1e-4)


def test_daly_when_a_save_costs_two_mtbfs_or_more_is_the_mtbf():
    assert daly_interval(200.0, 100.0) == 100.0
    assert daly_interval(200.0, 100.0 + 1e-9) < 100.0  # just below the threshold: the formula, 8M/9
    assert daly_interval(200.0 - 1e-6, 100.0) == pytest.approx(800.0 / 9.0, rel=1e-6)


def test_free_saves_mean_saving_continuously():
    assert young_interval(0.0, DAY) == 0.0
    assert daly_interval(0.0, DAY) == 0.0
    a = advise(0.0, DAY, step_time_s=0.5)
    assert a.lost_fraction is None and a.every_steps == 1


@pytest.mark.parametrize("cost, mtbf", [(1.0, 0.0), (1.0, -5.0), (1.0, math.nan), (1.0, math.inf), (-1.0, DAY), (math.nan, DAY), (math.inf, DAY)])
def test_bad_inputs_raise_config_errors(cost, mtbf):
    for fn in (young_interval, daly_interval, advise):
        with pytest.raises(CheckpointConfigError):
            fn(cost, mtbf)


def test_bad_interval_step_time_and_restart():
    with pytest.raises(CheckpointConfigError, match="interval"):
        expected_lost_fraction(0.0, 1.0, DAY)
    with pytest.raises(CheckpointConfigError, match="restart"):
        expected_lost_fraction(10.0, 1.0, DAY, restart_s=-1.0)
    with pytest.raises(CheckpointConfigError, match="step time"):
        interval_to_steps(100.0, 0.0)
    with pytest.raises(CheckpointConfigError, match="interval"):
        interval_to_steps(-1.0, 1.0)
    with pytest.raises(CheckpointConfigError, match="mean time between failures"):
        advise(1.0, 0.0)


def test_lost_fraction_matches_the_model_and_its_first_order_form():
    tau, c, m = 3180.0621, 60.0, DAY
    # 1 - tau / (M (e^{(tau+C)/M} - 1)): (tau+C)/M = 0.0375007, e^x - 1 = 0.0382128, M * that = 3301.59
    naive = 1.0 - tau / (m * (math.exp((tau + c) / m) - 1.0))
    assert expected_lost_fraction(tau, c, m) == pytest.approx(naive, rel=1e-9)
    assert expected_lost_fraction(tau, c, m) == pytest.approx(0.036806, abs=1e-5)
    # first order: C/tau + (tau + C)/2M = 0.018868 + 0.018750 = 0.0376, within 3 %
    assert expected_lost_fraction(tau, c, m) == pytest.approx(c / tau + (tau + c) / (2 * m), rel=0.03)
    # a restart of R costs about R/M more
    r = 600.0
    assert expected_lost_fraction(tau, c, m, restart_s=r) - expected_lost_fraction(tau, c, m) == pytest.approx(r / m, rel=0.05)


def test_lost_fraction_without_overflow_far_past_the_mtbf():
    assert expected_lost_fraction(1e6, 10.0, 100.0) == pytest.approx(1.0)
    # tiny values stay accurate: about C/tau = 1e-9 / 1e-6
    assert expected_lost_fraction(1e-6, 1e-9, 1e9) == pytest.approx(1e-3, rel=1e-3)


def test_interval_to_steps_rounds_to_the_nearest_whole_step():
    assert interval_to_steps(3180.0621, 1.5) == 2120  # 2120.04
    assert interval_to_steps(10.0, 4.0) == 2  # 2.5 rounds to even
    assert interval_to_steps(0.1, 2.0) == 1  # never less than one step


def test_advise_puts_it_together():
    a = advise(60.0, DAY, step_time_s=1.5, restart_s=300.0)
    assert a.young_s == young_interval(60.0, DAY)
    assert a.recommended_s == a.daly_s == daly_interval(60.0, DAY)
    assert a.every_steps == 2120
    assert a.lost_fraction == expected_lost_fraction(a.daly_s, 60.0, DAY, 300.0)
    assert set(a.as_dict()) == {"cost_s", "mtbf_s", "restart_s", "young_s", "daly_s", "recommended_s",
                                "lost_fraction", "step_time_s", "every_steps"}
    assert advise(60.0, DAY).every_steps is None


mtbfs = st.floats(min_value=1.0, max_value=1e8)
fractions = st.floats(min_value=1e-9, max_value=0.999)  # C / 2M, inside Daly's formula range


@settings(max_examples=200, deadline=None)
@given(mtbfs, fractions)
def test_daly_never_exceeds_young_and_loses_no_more(m, f):
    c = 2 * m * f
    young, daly = young_interval(c, m), daly_interval(c, m)
    assert 0 < daly <= young * (1 + 1e-12)
    assert expected_lost_fraction(daly, c, m) <= expected_lost_fraction(young, c, m) + 1e-12


@settings(max_examples=200, deadline=None)
@given(mtbfs, fractions, st.floats(min_value=1.0, max_value=100.0))
def test_daly_grows_with_mtbf_and_with_cost(m, f, k):
    c = 2 * m * f
    assert daly_interval(c, m * k) >= daly_interval(c, m) * (1 - 1e-12)  # C/2(kM) is still < 1
    c2 = min(c * k, 2 * m * 0.999)
    assert daly_interval(c2, m) >= daly_interval(c, m) * (1 - 1e-12) - 1e-9
    assert young_interval(c, m * k) >= young_interval(c, m)


@settings(max_examples=100, deadline=None)
@given(mtbfs, st.floats(min_value=1e-9, max_value=0.05))
def test_daly_is_near_the_minimum_of_the_loss(m, f):
    c = 2 * m * f
    tau = daly_interval(c, m)
    best = expected_lost_fraction(tau, c, m)
    for k in (0.8, 0.95, 1.05, 1.25):
        assert best <= expected_lost_fraction(tau * k, c, m) + 1e-12
