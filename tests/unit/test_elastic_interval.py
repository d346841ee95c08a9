"""How often ``trainpod.elastic.run`` copies the state (trainpod.elastic.interval):
Young/Daly on the measured costs, and what the ranks agree on."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainpod.elastic.interval import MOST_STEPS, Agreed, every_steps, expected_loss, mtbf
from trainpod.mtbf import DEFAULT_MTBF_S, young_daly_s


def test_the_gpt_examples_figures_copy_about_every_eight_steps() -> None:
    """A 3.7 ms copy, 120 ms steps, a fault every 2 minutes: sqrt(2 C M) - C = 0.94 s."""
    agreed = Agreed(copy_s=0.0037, step_s=0.120, elapsed_s=600.0, faults=5)
    assert young_daly_s(0.0037, 120.0) == pytest.approx(0.9386, abs=0.0005)
    assert every_steps(agreed) == 8
    per_step = expected_loss(0.0037, 0.120, 120.0, 1)
    chosen = expected_loss(0.0037, 0.120, 120.0, 8)
    assert per_step == pytest.approx(0.030, abs=0.001)  # 3% of the run to copies
    assert chosen < per_step / 3


def test_until_both_costs_are_measured_every_step_is_copied() -> None:
    assert every_steps(Agreed(0.0, 0.1, 100.0, 1)) == 1
    assert every_steps(Agreed(0.01, 0.0, 100.0, 1)) == 1


def test_before_any_fault_the_prior_holds_and_a_long_quiet_run_outgrows_it() -> None:
    assert mtbf(10.0, 0) == DEFAULT_MTBF_S
    assert mtbf(10.0, 0, prior_s=60.0) == 60.0
    assert mtbf(8 * 3600.0, 0) == 8 * 3600.0  # eight hours without a fault: at least that
    assert mtbf(600.0, 5) == 120.0  # then what was seen


def test_a_copy_that_costs_nothing_is_still_bounded_in_steps() -> None:
    assert every_steps(Agreed(1.0, 1e-6, 1e9, 0)) == MOST_STEPS


@given(
    copy_s=st.floats(1e-5, 1.0),
    step_s=st.floats(1e-3, 10.0),
    mtbf_s=st.floats(10.0, 1e6),
)
def test_the_chosen_interval_loses_no_more_than_its_neighbours(
    copy_s: float, step_s: float, mtbf_s: float
) -> None:
    """The interval chosen is the best whole number of steps: no neighbour loses less (the
    loss is convex in the interval, so no other number does either)."""
    every = every_steps(Agreed(copy_s, step_s, mtbf_s * 3, 3))
    assert 1 <= every <= MOST_STEPS
    chosen = expected_loss(copy_s, step_s, mtbf_s, every)
    for other in (max(1, every - 1), every + 1):
        if other <= MOST_STEPS and every < MOST_STEPS:
            assert chosen <= expected_loss(copy_s, step_s, mtbf_s, other) * (1 + 1e-9)
    assert math.isfinite(chosen)
